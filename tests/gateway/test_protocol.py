"""The gateway-worker protocol: encoding, and refusal of a worker of another version."""

from __future__ import annotations

import msgpack
import pytest
import zmq

from kiln.protocol import PROTOCOL_VERSION, Done, Generate, ProtocolError, Register, Registered, decode, encode
from kiln.protocol.request import ContentPart, GenerateRequest, Message
from kiln.protocol.security import secure_worker_socket
from kiln.protocol.usage import Usage


def test_round_trip_keeps_every_field():
    msg = Generate(req_id="r1", response_id="resp_1", request=GenerateRequest("m", input=(Message("user", (ContentPart("input_text", "hé"),)),)))
    assert decode(encode(msg)) == msg
    done = Done("r1", "completed", Usage(input_tokens=3), None)
    assert decode(encode(done)) == done


def test_unknown_fields_from_a_newer_peer_are_ignored():
    frame = msgpack.packb({"t": "Done", "req_id": "r", "status": "completed", "usage": {}, "new_field": 1})
    assert decode(frame) == Done("r", "completed", Usage(), None)


@pytest.mark.parametrize("frame", [b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"t": "Nope"}), msgpack.packb({"t": "Done"})])
def test_bad_frames_raise_protocol_error(frame):
    with pytest.raises(ProtocolError):
        decode(frame)


def test_gateway_refuses_other_protocol_version(scripted_kiln):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    secure_worker_socket(sock, scripted_kiln.secret)
    sock.connect(scripted_kiln.zmq)
    try:
        sock.send(encode(Register("w-old", "old-model", [], 2048, 1, 1, version=PROTOCOL_VERSION + 1)))
        reply = decode(sock.recv())
        assert isinstance(reply, Registered) and not reply.ok and "version" in reply.error
    finally:
        sock.close()


@pytest.mark.parametrize("register", [
    Register("w-bad", "bad-model", [], -1, 1, 1),
    Register("w-bad", "bad-model", [], 1 << 40, 1, 1),
    Register("w-bad", "", [], 2048, 1, 1),
    Register("w-bad", "bad-model", "not-a-list", 2048, 1, 1),
    Register("w-bad", "bad-model", [], 2048, 0, 1),
], ids=["negative-window", "huge-window", "no-model", "aliases", "no-capacity"])
def test_gateway_refuses_a_register_no_worker_can_send(scripted_kiln, register):
    """The context window bounds the usage a worker may report, so it is checked like usage is."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    secure_worker_socket(sock, scripted_kiln.secret)
    sock.connect(scripted_kiln.zmq)
    try:
        sock.send(encode(register))
        reply = decode(sock.recv())
        assert isinstance(reply, Registered) and not reply.ok and reply.error != "reregister"
    finally:
        sock.close()
