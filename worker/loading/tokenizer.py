"""The worker's tokenizer: ids, text, end-of-turn tokens and the chat template.

One class wraps a Hugging Face `tokenizers.Tokenizer` whatever the model came
from (a GGUF's metadata or an HF/mlx-lm folder), so the rest of the worker
(prompt rendering, token counting, streaming, grammars) has one interface.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from .chat_template import render_chat_template
from .gguf_vocab import build_hf_tokenizer, special_token_id
from .stream_decoder import StreamDecoder, token_byte_table

# End-of-turn markers used by common chat formats. Any of them that exists in
# a vocabulary as an added token stops generation, besides the declared EOS:
# a model that ends a turn with <|im_end|> while its EOS is <|endoftext|>
# must not run on.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "</s>",
)


class Tokenizer:
    """Text <-> ids for one model, plus its chat template and stop tokens."""

    def __init__(
        self,
        hf: HFTokenizer,
        *,
        chat_template: str | None,
        bos_token_id: int | None,
        eos_token_ids: Iterable[int],
        special_tokens: Mapping[str, str] | None = None,
    ) -> None:
        self._hf = hf
        self._chat_template = chat_template
        self._bos_token_id = bos_token_id
        added = hf.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        vocab = hf.get_vocab(with_added_tokens=True)
        declared = [i for i in eos_token_ids if i is not None]
        eos = set(declared)
        eos.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab and vocab[t] in added)
        self._eos_token_ids = frozenset(eos)
        self._special_tokens = dict(special_tokens or {})
        self._special_tokens.setdefault("bos_token", self._text_of(bos_token_id))
        self._special_tokens.setdefault("eos_token", self._text_of(declared[0] if declared else None))
        self._byte_table = token_byte_table(hf, self._special_ids) if _is_byte_level(hf) else None

    # --- construction -------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, md: Mapping[str, Any]) -> Tokenizer:
        """Build from the `tokenizer.*` keys of a GGUF (as returned by `mx.load`)."""
        hf = build_hf_tokenizer(md)
        template = md.get("tokenizer.chat_template")
        return cls(
            hf,
            chat_template=str(template) if template else None,
            bos_token_id=special_token_id(md, "bos"),
            # eot/eom: end-of-turn / end-of-message ids that llama.cpp also stops on.
            eos_token_ids=[
                i for i in (special_token_id(md, n) for n in ("eos", "eot", "eom")) if i is not None
            ],
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        """Build from `tokenizer.json` (+ `tokenizer_config.json`, generation/config files)."""
        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json")
        hf = HFTokenizer.from_file(str(tok_file))
        cfg = _read_json(folder / "tokenizer_config.json")
        vocab = hf.get_vocab(with_added_tokens=True)

        special: dict[str, str] = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            text = _token_text(cfg.get(key))
            if text is not None:
                special[key] = text

        # The tokenizer's own EOS first: it names `eos_token` in templates.
        eos_ids: list[int] = []
        if special.get("eos_token") in vocab:
            eos_ids.append(vocab[special["eos_token"]])
        for name in ("generation_config.json", "config.json"):
            eos_ids.extend(_as_ids(_read_json(folder / name).get("eos_token_id")))

        return cls(
            hf,
            chat_template=_folder_chat_template(folder, cfg),
            bos_token_id=vocab.get(special["bos_token"]) if "bos_token" in special else None,
            eos_token_ids=eos_ids,
            special_tokens=special,
        )

    # --- properties ---------------------------------------------------

    @property
    def hf_tokenizer(self) -> HFTokenizer:
        """The underlying `tokenizers.Tokenizer` (e.g. for building llguidance)."""
        return self._hf

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end generation: the declared EOS and end-of-turn tokens."""
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self._special_ids

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (may be below the model's logit width)."""
        return self._hf.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    # --- ids and text -------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Tokenize `text`. Special-token text such as `<|im_start|>` maps to its single id.

        `add_special_tokens` applies the tokenizer's post-processor (e.g. a BOS);
        off by default because chat templates write their own.
        """
        return self._hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of an id (byte-level form, e.g. 'Ġthe'), or None."""
        return self._hf.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._hf.token_to_id(token)

    def stream_decoder(self, *, skip_special_tokens: bool = False) -> StreamDecoder:
        """A fresh incremental decoder for one generation stream."""
        return StreamDecoder(
            self._hf,
            byte_table=self._byte_table,
            special_ids=self._special_ids,
            skip_special_tokens=skip_special_tokens,
        )

    # --- chat ---------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render `messages` with the model's chat template (HF-compatible Jinja).

        Raises ValueError if the model has no chat template, ChatTemplateError
        if the template rejects the input.
        """
        if not self._chat_template:
            raise ValueError("this model has no chat template")
        return render_chat_template(
            self._chat_template,
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self._special_tokens,
            **kwargs,
        )

    def _text_of(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self._hf.id_to_token(token_id) or ""


def _is_byte_level(hf: HFTokenizer) -> bool:
    """True when the decoder is GPT-2 byte-level (alone or in a sequence)."""
    if hf.decoder is None:
        return False
    decoder = json.loads(hf.decoder.__getstate__())
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(p.get("type") == "ByteLevel" for p in parts)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as fh:
        data = json.load(fh)
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as "text" or {"content": "text", ...}.
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(content := value.get("content"), str):
        return content
    return None


def _as_ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _folder_chat_template(folder: Path, cfg: Mapping[str, Any]) -> str | None:
    """The default chat template of an HF folder, wherever this folder keeps it."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    legacy = _read_json(folder / "chat_template.json").get("chat_template")
    template = cfg.get("chat_template", legacy)
    if isinstance(template, list):
        # Named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None
