"""Model names from the Hugging Face Hub: `org/name` (a safetensors repo: config, tokenizer,
weights), `org/name:QUANT` (a GGUF repo's file of that quantization, as llama.cpp's `-hf` picks
it), `org/name/file.gguf` (that file), each with an optional `@revision`. Files go through
huggingface_hub into the standard Hugging Face cache (files other tools fetched are reused;
HF_TOKEN for gated repos, HF_ENDPOINT, HF_HUB_OFFLINE=1 honoured). Before anything is fetched the
files' sizes (the Hub lists them) are checked against the free disk of the cache.

Every failure is a ModelNotFoundError that says what happened: the repo is not there, is gated
without a token, has no file of that quantization (listing those it has), or is not in the cache
while offline (naming the cache)."""

from __future__ import annotations

import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from flashmemory.errors import ModelNotFoundError

logger = logging.getLogger(__name__)

# org/name, then an optional /file.gguf, :QUANT and @revision (the Hub's own id characters).
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?:/(?P<file>[^:@]+\.gguf))?"
                     r"(?::(?P<quant>[\w.-]+))?(?:@(?P<revision>[\w./-]+))?$")
DEFAULT_QUANT = "Q4_K_M"  # llama.cpp's -hf default
# What a safetensors model needs: its config, tokenizer and chat template files, the weights.
_SAFETENSORS_FILES = ("*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken")
_QUANT_IN_NAME = re.compile(r"(?:^|[-.])(I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|F32)(?=[-.]|$)")
_resolved: dict[str, Path] = {}  # one lookup per id and process


@dataclass(frozen=True)
class HubId:
    repo: str
    file: str | None = None
    quant: str | None = None
    revision: str | None = None

    @classmethod
    def parse(cls, text: str) -> HubId | None:
        """The id `text` names, or None when it is not one (a path: absolute, relative, ~)."""
        if text.startswith(("/", ".", "~")) or "\\" in text or text.count("/") > 2:
            return None
        m = _HUB_ID.match(text)
        if m is None:
            return None
        return cls(m["repo"], m["file"], m["quant"], m["revision"])


def looks_like_hub_id(text: str) -> bool:
    return HubId.parse(text) is not None


def gguf_quant(filename: str) -> str | None:
    """The quantization a GGUF file's name states (Q4_K_M, IQ4_XS, F16, ...), upper-cased."""
    stem = filename.rsplit("/", 1)[-1].removesuffix(".gguf").upper()
    found = _QUANT_IN_NAME.findall(stem)
    return found[-1] if found else None


def choose_gguf(repo: str, files: list[str], quant: str) -> str:
    """The GGUF file of `quant` (the first part, where it is split); ModelNotFoundError listing
    the quantizations there are."""
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    matching = [f for f in ggufs if (gguf_quant(f) or "") == quant.upper()]
    if not matching:
        there = sorted({q for f in ggufs if (q := gguf_quant(f))})
        raise ModelNotFoundError(
            f"{repo} has no GGUF file of quantization {quant}; it has: {', '.join(there) or 'none'}"
            f" (ask for one as {repo}:{there[0] if there else 'QUANT'})")
    return next((f for f in matching if "-00001-of-" in f), matching[0])


def _wants_gguf(hub_id: HubId, files: list[str]) -> bool:
    """Whether the id means a GGUF file of the repo: a :QUANT was asked for, or the repo holds GGUF
    files and no safetensors config."""
    has_gguf = any(f.endswith(".gguf") for f in files)
    return hub_id.quant is not None or (has_gguf and "config.json" not in files)


def resolve_hub_model(text: str) -> Path:
    """The local path of the model `text` names on the Hub, fetched into the Hugging Face cache
    where it is not there yet."""
    if text in _resolved:
        return _resolved[text]
    hub_id = HubId.parse(text)
    if hub_id is None:
        raise ModelNotFoundError(f"{text!r} is not a Hugging Face Hub id (org/name, "
                                 "org/name:QUANT or org/name/file.gguf)")
    try:
        import huggingface_hub  # noqa: F401
    except ImportError as e:
        raise ModelNotFoundError(f"{text!r} names a Hub model: pip install huggingface_hub") from e
    path = _fetch(hub_id)
    _resolved[text] = path
    return path


def _fetch(hub_id: HubId) -> Path:
    from huggingface_hub import constants, hf_hub_download, snapshot_download
    from huggingface_hub import errors as hub_errors

    repo, revision = hub_id.repo, hub_id.revision
    cache = Path(constants.HF_HUB_CACHE)
    try:
        if constants.is_offline_mode():
            return _from_cache(hub_id, cache)
        if hub_id.file is not None:
            _check_room(repo, {hub_id.file: _sizes(repo, revision).get(hub_id.file)}, cache)
            return Path(hf_hub_download(repo, hub_id.file, revision=revision))
        sizes = _sizes(repo, revision)
        if _wants_gguf(hub_id, list(sizes)):
            name = choose_gguf(repo, list(sizes), hub_id.quant or DEFAULT_QUANT)
            parts = _split_parts(name, sizes)
            if len(parts) > 1:  # refused before gigabytes are fetched
                raise ModelNotFoundError(
                    f"{repo}'s {hub_id.quant or DEFAULT_QUANT} file is split in {len(parts)} parts "
                    f"({name}, ...); split GGUF files are not read yet: merge them with "
                    "llama.cpp's `llama-gguf-split --merge` and pass the merged file's path")
            _check_room(repo, {name: sizes[name]}, cache)
            return Path(hf_hub_download(repo, name, revision=revision))
        if "config.json" not in sizes or not any(f.endswith(".safetensors") for f in sizes):
            raise ModelNotFoundError(
                f"{repo} holds neither a GGUF file nor config.json with *.safetensors; its files: "
                f"{', '.join(sorted(sizes)[:12])}")
        wanted = {f: n for f, n in sizes.items() if f.endswith(".safetensors")}
        _check_room(repo, wanted, cache)
        return Path(snapshot_download(repo, revision=revision,
                                      allow_patterns=list(_SAFETENSORS_FILES)))
    except hub_errors.GatedRepoError as e:
        raise ModelNotFoundError(
            f"{repo} is gated: accept its terms on the Hub with your account, then set HF_TOKEN "
            "(or run `hf auth login`)") from e
    except hub_errors.RepositoryNotFoundError as e:
        raise ModelNotFoundError(
            f"{repo} was not found on the Hugging Face Hub ({constants.ENDPOINT}); check the id, "
            "or set HF_TOKEN for a private repo") from e
    except hub_errors.RevisionNotFoundError as e:
        raise ModelNotFoundError(f"{repo} has no revision {revision!r}") from e
    except (hub_errors.LocalEntryNotFoundError, hub_errors.OfflineModeIsEnabled) as e:
        raise ModelNotFoundError(
            f"{repo} is not in the Hugging Face cache ({cache}) and the Hub cannot be reached "
            "(HF_HUB_OFFLINE=1, or no network): fetch it once online, or pass a local path") from e
    except hub_errors.EntryNotFoundError as e:
        raise ModelNotFoundError(f"{repo} has no file {hub_id.file!r}") from e
    except hub_errors.HfHubHTTPError as e:
        raise ModelNotFoundError(f"the Hub refused {repo}: {e}") from e
    except OSError as e:  # the network is down or refused the connection
        raise ModelNotFoundError(
            f"the Hugging Face Hub ({constants.ENDPOINT}) cannot be reached for {repo}: {e}; set "
            "HF_HUB_OFFLINE=1 to use the cache only, or pass a local path") from e


def _sizes(repo: str, revision: str | None) -> dict[str, int | None]:
    """The repo's files and their sizes in bytes (None where the Hub gives none)."""
    from huggingface_hub import HfApi

    info = HfApi().model_info(repo, revision=revision, files_metadata=True)
    return {s.rfilename: s.size for s in info.siblings or []}


def _split_parts(name: str, sizes: dict[str, int | None]) -> list[str]:
    """A split GGUF's parts in order (name-00001-of-0000N.gguf ...), or [name]."""
    m = re.search(r"-00001-of-(\d{5})\.gguf$", name)
    if m is None:
        return [name]
    head = name[: m.start()]
    parts = [f"{head}-{i:05d}-of-{m[1]}.gguf" for i in range(1, int(m[1]) + 1)]
    missing = [p for p in parts if p not in sizes]
    if missing:
        raise ModelNotFoundError(f"the split GGUF {name} lacks its part(s) {', '.join(missing)}")
    return parts


def _check_room(repo: str, files: dict[str, int | None], cache: Path) -> None:
    """Refuse before fetching when the files cannot fit the cache's free disk."""
    total = sum(n or 0 for n in files.values())
    if not total:
        return
    folder = cache if cache.exists() else next((p for p in cache.parents if p.exists()), Path("/"))
    free = shutil.disk_usage(folder).free
    gib = 2**30
    if total > free:
        raise ModelNotFoundError(
            f"{repo}'s files are {total / gib:.1f} GiB but {folder} has {free / gib:.1f} GiB free; "
            "free disk space or set HF_HUB_CACHE to a larger disk")
    logger.info("fetching %s: %d file(s), %.1f MiB", repo, len(files), total / 2**20)


def _from_cache(hub_id: HubId, cache: Path) -> Path:
    """Offline: the cached snapshot's file or folder (LocalEntryNotFoundError when absent)."""
    from huggingface_hub import hf_hub_download, snapshot_download

    if hub_id.file is not None:
        return Path(hf_hub_download(hub_id.repo, hub_id.file, revision=hub_id.revision,
                                    local_files_only=True))
    folder = Path(snapshot_download(hub_id.repo, revision=hub_id.revision, local_files_only=True))
    files = [str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()]
    if _wants_gguf(hub_id, files):
        return folder / choose_gguf(hub_id.repo, files, hub_id.quant or DEFAULT_QUANT)
    return folder
