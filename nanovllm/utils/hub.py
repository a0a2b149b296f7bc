"""A `model` that is not a local directory is a Hugging Face repo id: the files the engine reads are
downloaded (or found in the cache) by huggingface_hub, and the engine reads its snapshot directory.
huggingface_hub itself honours HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE and HF_TOKEN."""
import os

# What the engine reads: config and generation config, tokenizer files, chat template, weights.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "merges.txt", "vocab.txt"]
# Sub-folders hold other formats (original/, onnx/); Mistral repos repeat the weights in Mistral's
# own layout (consolidated.safetensors), which the loader does not read.
IGNORE_PATTERNS = ["*/*", "consolidated*"]


def resolve_model(model: str, revision: str | None = None, download_dir: str | None = None,
                  argument: str = "model") -> str:
    """The local directory of `model`: itself when it is one, else the snapshot of the repo id
    (downloaded to `download_dir`, default the Hugging Face cache). Errors are ValueErrors naming
    `argument`."""
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        return path
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (HFValidationError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)
    try:
        return snapshot_download(model, revision=revision, cache_dir=download_dir,
                                 allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS)
    except HFValidationError:
        raise ValueError(f"{argument}: {model!r} is not a local directory, nor a Hugging Face repo id") from None
    except RevisionNotFoundError:
        raise ValueError(f"{argument}: the Hugging Face repo {model!r} has no revision {revision!r}") from None
    except RepositoryNotFoundError:
        raise ValueError(f"{argument}: {model!r} is not a local directory, and the Hugging Face Hub has no repo "
                         "of that name that this token may read (private and gated repos need HF_TOKEN)") from None
    except LocalEntryNotFoundError:
        cache = download_dir or constants.HF_HUB_CACHE
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hugging Face Hub could not be reached"
        at = "" if revision is None else f" at revision {revision!r}"
        raise ValueError(f"{argument}: {model!r} is not a local directory, {why}, and the cache {cache} holds "
                         f"no complete snapshot of it{at}") from None
    except (HfHubHTTPError, OSError) as error:
        raise ValueError(f"{argument}: could not download {model!r} from the Hugging Face Hub: {error}") from None
