"""output.push_to_hub: the final model dir (weights or adapter, tokenizer, model card) uploaded to a Hub repo
with huggingface_hub at the end of a run. The token is checked before training starts, so a missing login
fails in one line at once instead of after hours of training."""

from __future__ import annotations

from pathlib import Path

from disttrain.errors import DisttrainError


def check_token(repo_id: str | None) -> None:
    """Before training: a Hugging Face token must be configured (HF_TOKEN, or `huggingface-cli login`)."""
    if repo_id is None:
        return
    from huggingface_hub import get_token

    if not get_token():
        raise DisttrainError(f"output.push_to_hub={repo_id}: no Hugging Face token; set HF_TOKEN or run "
                             "`huggingface-cli login` (or remove output.push_to_hub)")


def push(final_dir: str | Path, repo_id: str, api=None) -> str:
    """Create the repo (private, if it does not exist) and upload the final dir; returns the repo's URL."""
    from huggingface_hub import HfApi

    api = api or HfApi()
    try:
        url = api.create_repo(repo_id, private=True, exist_ok=True)
        api.upload_folder(repo_id=repo_id, folder_path=str(final_dir), commit_message="disttrain: final model")
    except Exception as exc:  # network, permissions: the model stays on disk; say how to upload it by hand
        raise DisttrainError(f"output.push_to_hub={repo_id}: upload failed ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''}); the model is in {final_dir}: "
                             f"`huggingface-cli upload {repo_id} {final_dir}`") from None
    return str(url)
