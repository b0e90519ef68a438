"""``kiln models list|pull|rm``: the Hugging Face cache the workers load hub ids from.

The cache is huggingface_hub's own (HF_HOME / HF_HUB_CACHE), shared with other tools, so
`rm` removes a repo from it for every tool that uses it.
"""

from __future__ import annotations

import shutil
from typing import Any

import click


def _human(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size} B"


def _scan() -> Any:  # huggingface_hub's HFCacheInfo, or None without a cache
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        return scan_cache_dir()
    except CacheNotFound:
        return None


@click.group()
def models() -> None:
    """Models in the local Hugging Face cache (what `--model org/name` loads)."""


@models.command("list")
def list_models() -> None:
    """Cached models: repo, size, files (GGUF quantizations by name)."""
    from kiln.worker.loading.hub import cache_dir

    info = _scan()
    repos = sorted((r for r in info.repos if r.repo_type == "model"), key=lambda r: r.repo_id) if info else []
    if not repos:
        click.echo(f"no models in {cache_dir()}")
        return
    for repo in repos:
        ggufs = sorted({f.file_name for rev in repo.revisions for f in rev.files if f.file_name.endswith(".gguf")})
        kind = ("gguf: " + ", ".join(ggufs)) if ggufs else "mlx-lm folder"
        click.echo(f"{repo.repo_id}\t{_human(repo.size_on_disk)}\t{kind}")


@models.command()
@click.argument("model")
def pull(model: str) -> None:
    """Download MODEL (org/name[@revision][:QUANT]) into the cache, or confirm it is there."""
    from kiln.worker.loading.hub import HubModelError, parse_hub_id, resolve

    hub = parse_hub_id(model)
    if hub is None:
        raise click.UsageError(f"{model!r} is not a hub id (org/name[@revision][:QUANT])")
    try:
        path = resolve(hub)
    except HubModelError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"{hub.model_id}: {path}")


@models.command()
@click.argument("repo")
@click.option("--yes", is_flag=True, help="Do not ask before deleting.")
def rm(repo: str, yes: bool) -> None:
    """Delete REPO (org/name) and all its revisions from the cache."""
    from kiln.worker.loading.hub import cache_dir, parse_hub_id

    hub = parse_hub_id(repo)
    name = hub.repo if hub else repo
    info = _scan()
    found = [r for r in (info.repos if info else []) if r.repo_id == name and r.repo_type == "model"]
    if not found:
        raise click.ClickException(f"{name} is not in the cache at {cache_dir()}")
    target = found[0]
    if not yes:
        click.confirm(f"delete {name} ({_human(target.size_on_disk)})?", abort=True)
    strategy = info.delete_revisions(*(rev.commit_hash for rev in target.revisions))
    strategy.execute()
    # huggingface_hub removes the repo folder only when it believes no revision is left; refs,
    # `.no_exist` markers or a partial download can keep it, and the command promises the repo gone.
    shutil.rmtree(target.repo_path, ignore_errors=True)
    click.echo(f"deleted {name} ({strategy.expected_freed_size_str})")
