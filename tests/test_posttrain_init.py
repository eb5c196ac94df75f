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
