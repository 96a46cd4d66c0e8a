"""hf://org/repo[@revision]: adapters on the Hugging Face Hub, through huggingface_hub's own cache.

Only the adapter files are downloaded (ADAPTER_PATTERNS: never a pickle). HF_HUB_OFFLINE and HF_HUB_CACHE are
huggingface_hub's own settings; it reads them itself."""

from __future__ import annotations

from pathlib import Path

from app.catalog.sources.verify import ADAPTER_PATTERNS, adapter_files, check_size, verify_files
from app.errors import AdapterUnavailable
from app.names import check_name


class HubMissing(AdapterUnavailable):
    """The Hub (or its offline cache) has no such repo or revision: for AdapterHub.get(), an unknown name."""


def fetch(uri: str, files: dict[str, str] | None, *, max_bytes: int) -> Path:
    """The snapshot folder in the Hugging Face cache, size-checked and, when `files` is given, sha256-checked."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo, _, rev = uri[len("hf://") :].partition("@")
    check_name(repo)
    try:
        folder = Path(
            snapshot_download(repo_id=repo, revision=rev or None, allow_patterns=list(ADAPTER_PATTERNS))
        )
    except RevisionNotFoundError:
        raise HubMissing(f"{uri}: revision {rev!r} not found on the Hub") from None
    except RepositoryNotFoundError:
        raise HubMissing(
            f"{uri}: no such repository on the Hub, or it is private/gated (set HF_TOKEN)"
        ) from None
    except LocalEntryNotFoundError:
        how = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub cannot be reached"
        raise HubMissing(
            f"{uri}: not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {how}"
        ) from None
    except (HfHubHTTPError, OSError) as e:
        raise AdapterUnavailable(f"{uri}: Hugging Face Hub request failed ({e})") from None
    if files:
        verify_files(uri, folder, files)
    check_size(uri, sum((folder / n).stat().st_size for n in adapter_files(folder)), max_bytes)
    return folder
