"""Downloading model repos from the Hugging Face Hub (or the mirror in HF_ENDPOINT) with one-line,
actionable errors. huggingface_hub does the transfer (retries, Range resumes, local-dir metadata)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from .errors import RecipeError

__all__ = ["download", "hub_unreachable"]


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def hub_unreachable() -> str | None:
    """Why the Hub (HF_ENDPOINT) cannot be reached, when its host name does not resolve (no network), else None.
    huggingface_hub retries a request that fails so for ~30 s, printing each try; callers check first and say it
    in one line. Not checked when HF_HUB_OFFLINE is set (no request is made) or a proxy resolves names."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY",
                                                                    "http_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlparse(_endpoint())
    if not url.hostname:
        return None
    try:
        socket.getaddrinfo(url.hostname, url.port or (80 if url.scheme == "http" else 443), type=socket.SOCK_STREAM)
    except OSError:
        return f"{_endpoint()} is unreachable (its name does not resolve: no network?)"
    return None


def _offline_error(repo_id: str) -> RecipeError:
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return RecipeError(
            f"cannot download '{repo_id}': HF_HUB_OFFLINE is set; unset it, or copy the model files "
            "yourself and use the local path"
        )
    return RecipeError(
        f"cannot download '{repo_id}': {_endpoint()} is unreachable (no network?): set HF_ENDPOINT to a "
        "reachable mirror, or copy the model files yourself and use the local path"
    )


def download(
    repo_id: str,
    output_dir: str | Path,
    ignore_patterns: Sequence[str] | None = None,
    token: str | None = None,
    revision: str | None = None,
) -> Path:
    """Download a Hub repo's files into `output_dir` (resumes and skips files already there); returns it.

    The token is `token`, else `$HF_TOKEN`, else huggingface_hub's saved login; it is never printed.
    """
    import httpx2
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = _endpoint()
    if not endpoint.startswith(("http://", "https://")):  # httpx's UnsupportedProtocol traceback otherwise
        raise RecipeError(f"HF_ENDPOINT {endpoint!r} must be a URL starting with https:// (or http://)")
    token = token or os.environ.get("HF_TOKEN") or None
    out = Path(output_dir).expanduser()
    page = f"{endpoint}/{repo_id}"
    try:
        path = snapshot_download(
            repo_id,
            local_dir=out,
            revision=revision,
            ignore_patterns=list(ignore_patterns) if ignore_patterns else None,
            token=token,
        )
    except GatedRepoError as e:
        raise RecipeError(
            f"'{repo_id}' is gated: accept its license on {page} (signed in), then pass --hf-token "
            "or set HF_TOKEN to a token of that account"
        ) from e
    except RevisionNotFoundError as e:
        raise RecipeError(
            f"revision '{revision}' not found in '{repo_id}': check the branch, tag or commit on {page}"
        ) from e
    except RepositoryNotFoundError as e:
        hint = (
            "the token has no access to it"
            if token
            else "private repos need a token: pass --hf-token or set HF_TOKEN"
        )
        raise RecipeError(
            f"repo '{repo_id}' not found on {_endpoint()}: check the repo id (owner/name); {hint}"
        ) from e
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, httpx2.ConnectError, httpx2.TimeoutException) as e:
        raise _offline_error(repo_id) from e
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status == 401:
            raise RecipeError(
                f"the Hub rejected the token for '{repo_id}' (401): check --hf-token / HF_TOKEN"
            ) from e
        if status == 403:
            raise RecipeError(
                f"access to '{repo_id}' is forbidden (403): request access on {page} and use a token with read access"
            ) from e
        raise RecipeError(
            f"downloading '{repo_id}' failed: HTTP {status} from {_endpoint()}; retry later"
        ) from e
    except HFValidationError as e:
        raise RecipeError(f"invalid repo id '{repo_id}': expected owner/name ({e})") from e
    except PermissionError as e:
        raise RecipeError(f"cannot write to '{out}': permission denied; choose another --output-dir") from e
    return Path(path)
