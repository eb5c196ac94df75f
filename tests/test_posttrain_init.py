"""The checks every post-training kind makes before any model runs (lmforge.posttrain.init): where
its rows are, and what it says when they are not there."""

from __future__ import annotations

import pytest

from lmforge.config import load_config
from lmforge.errors import LMForgeError
from lmforge.train import train

KINDS = {"sft": "conversations", "reward": "preference pairs", "dpo": "preference pairs", "grpo": "prompts",
         "ppo": "prompts"}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_names_its_missing_rows_and_the_fix(kind, tmp_path):
    def config(**data):
        return load_config(values={"kind": kind, "out_dir": str(tmp_path), "data": data,
                                   "training": {"device": "cpu", "precision": "fp32"},
                                   "logging": {"tensorboard": False, "progress_bar": False}})

    what = KINDS[kind]
    with pytest.raises(LMForgeError, match=f"no {what}: set data.train_path to "):
        train(config())
    with pytest.raises(LMForgeError, match=f"the {kind} kind reads {what} from data.train_path; data.path "
                                           r"\(token shards\) is for the lm kind: remove it"):
        train(config(path=str(tmp_path)))
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(LMForgeError, match=f"data.train_path={missing} does not exist: point it at the {what}"):
        train(config(train_path=str(missing)))
    assert not any(tmp_path.iterdir())  # refused before a run directory was made


def test_sft_says_it_fine_tunes_the_checkpoint_other_kinds_that_they_start_from_it(tmp_path):
    """sft's checks are the shared init_model_config / init_tokenizer_path, in its own words."""
    from types import SimpleNamespace

    from lmforge.posttrain.init import init_model_config, init_tokenizer_path

    rows = tmp_path / "rows.jsonl"
    rows.write_text("")

    def config(**training):
        return load_config(values={"kind": "sft", "out_dir": str(tmp_path / "runs"), "data": {"train_path": str(rows)},
                                   "training": {"device": "cpu", "precision": "fp32", **training},
                                   "logging": {"tensorboard": False, "progress_bar": False}})

    missing = tmp_path / "no-such-checkpoint"
    with pytest.raises(LMForgeError, match=f"training.init_from={missing} does not exist: point it at the checkpoint "
                                           r"or run directory to fine-tune \(e.g. runs/code_assistant_code\)$"):
        train(config(init_from=str(missing)))
    with pytest.raises(LMForgeError, match="the sft kind needs the tokenizer the model is served with: set training."
                                           r"init_from to the checkpoint to fine-tune \(its tokenizer is used\), or "
                                           "data.tokenizer=PATH"):
        train(config())

    cfg = SimpleNamespace(training=SimpleNamespace(init_from=str(missing)), data=SimpleNamespace(tokenizer=""))
    with pytest.raises(LMForgeError, match=f"training.init_from={missing} does not exist: point it at the checkpoint "
                                           "or run directory the grpo kind starts from$"):
        init_model_config(cfg, "grpo")
    with pytest.raises(LMForgeError, match=r"set training.init_from to the checkpoint to start from \(its tokenizer"):
        init_tokenizer_path(cfg, None, "grpo")
