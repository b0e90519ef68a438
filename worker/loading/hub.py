"""Resolve Hugging Face hub ids (`org/name[@revision][:QUANT]`) to files in the local cache.

`--model mlx-community/Qwen3-4B-4bit` downloads (once, resumably, with huggingface_hub's
progress bar) only what the loaders read: config, tokenizer and safetensors files for
an mlx-lm repo, or one GGUF file for a GGUF repo, chosen by its quantization tag
(`org/name-GGUF:Q4_K_M`). Offline (`HF_HUB_OFFLINE=1`, or the hub unreachable) a cached
model resolves from the cache and a missing one fails at once with a message naming the
cache path, never a hang or a traceback.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelNotFoundError

# org/name, an optional @revision, an optional :file-tag (letters, digits, _ . -).
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[\w./-]+?))?(?::(?P<tag>[\w.-]+))?$")

# What the folder loader reads from an mlx-lm / transformers repo.
FOLDER_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt"]


class HubModelError(ModelNotFoundError):
    """A hub id that cannot be resolved (not cached offline, unknown, ambiguous)."""


@dataclass(frozen=True)
class HubId:
    repo: str
    revision: str | None = None
    tag: str | None = None  # a GGUF quantization tag such as Q4_K_M

    @property
    def model_id(self) -> str:
        """The id the model is served under: `org/name`, plus `:tag` when one file was chosen."""
        return f"{self.repo}:{self.tag}" if self.tag else self.repo


def parse_hub_id(text: str) -> HubId | None:
    """The hub id `text` names, or None when it is not shaped like one."""
    m = _HUB_ID.match(text)
    if m is None or text.startswith((".", "/", "~")):
        return None
    return HubId(m["repo"], m["rev"], m["tag"])


def cache_dir() -> Path:
    """Where huggingface_hub keeps downloads (HF_HUB_CACHE, else HF_HOME/hub)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "") in ("1", "true", "yes")


def _patterns(tag: str | None) -> list[str]:
    if tag is None:
        return [*FOLDER_PATTERNS, "*.gguf"]
    variants = {tag, tag.upper(), tag.lower()}
    return [f"*{v}*.gguf" for v in sorted(variants)] + [f"*/*{v}*.gguf" for v in sorted(variants)]


def _snapshot(hub: HubId, *, local_only: bool) -> Path:
    from huggingface_hub import snapshot_download

    return Path(
        snapshot_download(
            hub.repo, revision=hub.revision, allow_patterns=_patterns(hub.tag), local_files_only=local_only
        )
    )


def _download(hub: HubId) -> Path:
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    where = f"{hub.repo}" + (f"@{hub.revision}" if hub.revision else "")
    if _offline():
        try:
            return _snapshot(hub, local_only=True)
        except (LocalEntryNotFoundError, FileNotFoundError, ValueError) as exc:
            raise HubModelError(
                f"model {where} is not in the Hugging Face cache at {cache_dir()} and the hub is "
                f"offline (HF_HUB_OFFLINE=1): run `kiln models pull {hub.model_id}` with network access"
            ) from exc
    try:
        return _snapshot(hub, local_only=False)
    except RepositoryNotFoundError as exc:
        raise HubModelError(f"model {where} not found on the Hugging Face hub (or it needs a token)") from exc
    except (HfHubHTTPError, OSError, ValueError) as exc:
        try:  # no network: a cached copy still serves
            return _snapshot(hub, local_only=True)
        except Exception:
            raise HubModelError(
                f"model {where} could not be downloaded ({type(exc).__name__}) and is not in the "
                f"Hugging Face cache at {cache_dir()}"
            ) from exc


def _pick(snapshot: Path, hub: HubId) -> Path:
    """The folder or the single GGUF file in `snapshot` the loader should read."""
    ggufs = sorted(p for p in snapshot.rglob("*.gguf") if p.is_file())
    if hub.tag is not None:
        wanted = [p for p in ggufs if hub.tag.lower() in p.name.lower()]
        if not wanted:
            raise HubModelError(f"{hub.repo} has no GGUF file matching {hub.tag!r} (cache: {snapshot})")
        if len(wanted) > 1:
            names = ", ".join(p.name for p in wanted)
            raise HubModelError(f"{hub.repo}: {hub.tag!r} matches several files ({names}); split GGUFs are not supported")
        return wanted[0]
    if (snapshot / "config.json").is_file():
        return snapshot
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        tags = ", ".join(p.name for p in ggufs)
        raise HubModelError(f"{hub.repo} holds several GGUF files ({tags}): choose one as {hub.repo}:<QUANT>")
    raise HubModelError(f"{hub.repo} has neither config.json nor a .gguf file (cache: {snapshot})")


def resolve(hub: HubId) -> Path:
    """Download (or find in the cache) what `hub` names; return the folder or GGUF file."""
    return _pick(_download(hub), hub)
