import re

import pytest
import yaml

from lmforge.config import RECIPE_DIR, list_recipes, load_config, parse_overrides
from lmforge.errors import LMForgeError


def test_recipes_load_with_seed_settings():
    assert {"go_coder_tiny", "go_coder_125m"} <= set(list_recipes())
    cfg = load_config("go_coder_125m")
    m, t = cfg.model, cfg.training
    assert (m.n_layer, m.n_embd, m.n_head, m.n_positions, m.flavor) == (12, 768, 12, 1024, "gpt2")
    assert (t.beta1, t.beta2, t.lr, t.weight_decay, t.warmup_steps) == (0.9, 0.95, 5e-4, 0.1, 2000)
    assert (t.schedule, t.grad_clip, t.micro_batch_size, t.grad_accum_steps) == ("cosine", 1.0, 2, 8)
    assert (t.eval_interval, t.save_interval, t.keep_last) == (500, 1000, 3)


# Seed 001's TrainingArguments (seed 000 writes the same names), as a recipe layer would give them.
TRAINER_ARGS = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 8, "learning_rate": 5e-4,
                "lr_scheduler_type": "cosine", "warmup_steps": 2000, "weight_decay": 0.1, "num_train_epochs": 3,
                "fp16": True, "logging_steps": 50, "eval_steps": 500, "save_steps": 1000, "save_total_limit": 3,
                "adam_beta1": 0.85, "adam_beta2": 0.95, "adam_epsilon": 1e-7, "max_grad_norm": 0.5, "seed": 7}


@pytest.mark.parametrize("recipe", ["go_coder_tiny", "hrgc_go_tiny", "trm_sudoku_tiny"])
def test_hugging_face_trainer_names_are_read_by_every_kind(recipe):
    cfg = load_config(recipe, values={"training": TRAINER_ARGS})
    t = cfg.training
    assert (t.micro_batch_size, t.grad_accum_steps, t.lr, t.schedule, t.warmup_steps, t.weight_decay) == (
        2, 8, 5e-4, "cosine", 2000, 0.1)
    assert (t.epochs, t.precision, t.log_interval, t.eval_interval, t.save_interval, t.keep_last) == (
        3, "fp16", 50, 500, 1000, 3)
    assert (t.beta1, t.beta2, t.eps, t.grad_clip, cfg.seed) == (0.85, 0.95, 1e-7, 0.5, 7)
    # a flag that is off leaves the precision as it was; the Trainer's schedule names map to lmforge's
    off = load_config(recipe, ["training.fp16=false", "training.bf16=true",
                               "training.lr_scheduler_type=constant_with_warmup"]).training
    assert (off.precision, off.schedule) == ("bf16", "constant")
    assert load_config(recipe, ["training.mixed_precision=no"]).training.precision == "fp32"
    # both flags off is the Trainer's full precision (auto would pick fp16 on an older GPU)
    assert load_config(recipe, ["training.fp16=false", "training.bf16=false"]).training.precision == "fp32"
    assert load_config(recipe, ["training.fp16=false", "training.precision=bf16"]).training.precision == "bf16"
    # a pasted TrainingArguments dump: the Trainer's defaults that are lmforge's behaviour load
    dump = load_config(recipe, values={"training": {**TRAINER_ARGS, "optim": "adamw_torch", "warmup_ratio": 0.0,
                                                    "max_steps": -1, "dataloader_num_workers": 0}}).training
    assert (dump.epochs, dump.lr) == (3, 5e-4)


@pytest.mark.parametrize("override, message", [
    ("training.per_device_eval_batch_size=4", "has no lmforge key: evaluation runs training.micro_batch_size"),
    ("training.warmup_ratio=0.1", "give the warmup as training.warmup_steps"),
    ("training.optim=sgd", "lmforge trains with AdamW"),
    ("training.fp16=true training.bf16=true", "training.fp16 and training.bf16 are both true: keep one"),
    ("training.lr_scheduler_type=linear", "'linear' has no lmforge schedule; use one of cosine"),
    ("training.fp16=1", "training.fp16 must be true or false"),
    ("training.save_total_limit=null", "save_total_limit=null (the Trainer keeps every checkpoint) has no lmforge"),
])
def test_trainer_settings_without_a_key_say_what_lmforge_does_instead(override, message):
    with pytest.raises(LMForgeError, match=re.escape(message)):
        load_config("go_coder_tiny", override.split())
    with pytest.raises(LMForgeError, match="'training.learning_rate' and 'training.lr' are both given"):
        load_config("go_coder_tiny", ["training.learning_rate=1e-3", "training.lr=2e-3"])
    with pytest.raises(LMForgeError, match="'training.bf16' and 'training.precision' are both given"):
        load_config("go_coder_tiny", ["training.bf16=true", "training.precision=fp32"])


def test_a_key_and_the_one_that_switches_it_off_in_one_place_is_an_error():
    """Across layers the later wins (the user's max_steps over a recipe's epochs); in one command line one of
    the two would be silently ignored (seed 003's `epochs=500` beside `training.max_steps=3` trained 5,000
    steps)."""
    with pytest.raises(LMForgeError, match=r"training.max_steps=3 and training.epochs=500 are both given in one "
                                           r"place.*training.epochs=0 switches it off"):
        load_config("hrm_sudoku", ["epochs=500", "training.max_steps=3"])
    with pytest.raises(LMForgeError, match="training.micro_batch_size=4 and training.global_batch_size=8"):
        load_config("go_coder_tiny", ["training.micro_batch_size=4", "training.global_batch_size=8"])
    with pytest.raises(LMForgeError, match="training.max_steps=5 and training.num_train_epochs=1 are both given"):
        load_config("go_coder_tiny", ["training.num_train_epochs=1", "training.max_steps=5"])  # as the user wrote it
    assert load_config("hrm_sudoku", ["training.max_steps=3"]).training.max_steps == 3  # over the recipe's epochs
    assert load_config("hrm_sudoku", ["epochs=0", "training.max_steps=3"]).training.max_steps == 3


def test_dotted_overrides_are_typed_and_applied():
    cfg = load_config("go_coder_tiny", ["training.max_steps=200", "model.n_layer=3", "training.lr=5e-4",
                                        "training.compile=true", "name=x"])
    assert cfg.training.max_steps == 200 and cfg.model.n_layer == 3 and cfg.name == "x"
    assert cfg.training.lr == 5e-4 and cfg.training.compile is True


@pytest.mark.parametrize("override, suggestion", [
    ("training.max_step=5", "training.max_steps"),
    ("model.n_layers=4", "model.n_layer"),
    ("trainig.lr=1", None),
])
def test_unknown_key_names_closest_valid_key(override, suggestion):
    with pytest.raises(LMForgeError) as e:
        load_config("go_coder_tiny", [override])
    msg = str(e.value)
    assert "unknown config key" in msg
    if suggestion:
        assert f"Did you mean '{suggestion}'" in msg


def test_wrong_types_and_values_are_rejected():
    with pytest.raises(LMForgeError, match="expects an integer"):
        load_config("go_coder_tiny", ["training.max_steps=ten"])
    with pytest.raises(LMForgeError, match="schedule"):
        load_config("go_coder_tiny", ["training.schedule=linearish"])
    with pytest.raises(LMForgeError, match="no '='"):
        parse_overrides(["training.max_steps"])
    with pytest.raises(LMForgeError, match="unknown recipe 'go_coder_tiyn'.*go_coder_tiny"):
        load_config("go_coder_tiyn")
    # was silently ignored under ddp: a GPU user would believe the shards offloaded
    with pytest.raises(LMForgeError, match="fsdp_offload .* training.parallel=ddp .* set training.parallel=fsdp"):
        load_config("go_coder_tiny", ["training.fsdp_offload=true"])
    assert load_config("go_coder_tiny", ["training.fsdp_offload=true", "training.parallel=fsdp"]).training.fsdp_offload


def test_resolved_config_round_trips_through_yaml(tmp_path):
    cfg = load_config("go_coder_tiny", ["model.n_embd=96"])
    cfg.save(tmp_path / "config.yaml")
    raw = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert raw["model"]["family"] == "gpt" and raw["model"]["n_embd"] == 96
    again = load_config(str(tmp_path / "config.yaml"))
    assert again.to_dict() == cfg.to_dict()


def test_numbers_in_a_recipe_file_are_numbers_and_must_be_finite(tmp_path):
    """YAML 1.1 reads `lr: 1e-3` as the string '1e-3': in a recipe file it is the number the user wrote, as on
    the command line. Infinite or NaN values are refused for every number (an integer key raised OverflowError)."""
    recipe = yaml.safe_load((RECIPE_DIR / "go_coder_tiny.yaml").read_text())
    recipe["training"].update(lr="1e-3", peak_flops="1.5e12", max_steps="2e2")
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert yaml.safe_load(path.read_text().replace("'", ""))["training"]["lr"] == "1e-3"  # the quirk itself
    path.write_text(path.read_text().replace("'", ""))
    t = load_config(str(path)).training
    assert (t.lr, t.peak_flops, t.max_steps) == (1e-3, 1.5e12, 200) and isinstance(t.max_steps, int)
    assert load_config(str(path), ["training.max_steps='9007199254740993'"]).training.max_steps == 2**53 + 1
    for override, expected in (("training.max_steps=.inf", "'training.max_steps' expects an integer, got inf"),
                               ("training.max_steps=.nan", "'training.max_steps' expects an integer, got nan"),
                               ("training.max_steps=2.5", "expects an integer, got 2.5"),
                               ("training.lr=.inf", "'training.lr' expects a finite number, got inf"),
                               ("training.max_time_minutes=-.inf", "expects a finite number, got -inf"),
                               ("training.lr=abc", "'training.lr' expects a number, got 'abc'"),
                               ("training.lr=true", "'training.lr' expects a number, got True")):
        with pytest.raises(LMForgeError, match=expected.replace(".", r"\.")):
            load_config(str(path), [override])


SECTION_REFUSED = "config section '{}' must be a mapping, got {} (to change one key write {}.KEY=VALUE"


@pytest.mark.parametrize("override, section, got", [
    ("model=", "model", "''"), ("model=null", "model", "None"), ("training=null", "training", "None"),
    ("training=", "training", "''"), ("data=null", "data", "None"), ("logging=5", "logging", "5"),
    ("recipe=[1]", "recipe", "[1]"),
])
def test_a_section_that_is_not_a_mapping_is_refused_not_replaced_by_defaults(override, section, got):
    """`model=` or `model=null` gave the all-defaults model (GPT-2 125M) instead of the recipe's."""
    with pytest.raises(LMForgeError, match=re.escape(SECTION_REFUSED.format(section, got, section))):
        load_config("go_coder_tiny", [override])


def test_a_null_section_from_python_or_a_recipe_file_is_refused(tmp_path):
    with pytest.raises(LMForgeError, match=re.escape(SECTION_REFUSED.format("model", "None", "model"))):
        load_config("go_coder_tiny", [], values={"model": None})
    path = tmp_path / "r.yaml"
    path.write_text("name: x\nmodel:\ntraining: {max_steps: 3}\n")
    with pytest.raises(LMForgeError, match=re.escape(f"{path}: " + SECTION_REFUSED.format("model", "None", "model"))):
        load_config(str(path))


def test_a_recipe_file_that_is_not_utf8_or_is_empty_is_refused(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"name: x\nmodel: {family: gpt}\n\xe9\n")
    with pytest.raises(LMForgeError, match=re.escape(f"{path} is not UTF-8 text (byte 0xe9 at offset 29): "
                                                     "save it as UTF-8")):
        load_config(str(path))
    for text in ("", "# only a comment\n\n"):
        path.write_text(text)
        with pytest.raises(LMForgeError, match=re.escape(f"{path} is empty (or only comments): write the run's")):
            load_config(str(path))


def nested_aliases(levels: int) -> list:
    """What a YAML "billion laughs" loads as: 9 references to the same list, `levels` deep (cheap in memory)."""
    value: list = [1] * 9
    for _ in range(levels):
        value = [value] * 9
    return value


def test_huge_values_give_short_error_messages(tmp_path):
    """A few hundred bytes of YAML aliases made a 254 MB error message (13 s, 1.1 GB)."""
    for values, expected in (({"seed": nested_aliases(4)}, "'seed' expects an integer, got [[[[...], "),
                             ({"training": {"parallel": "x" * 10**5}}, "training.parallel must be ddp"),
                             ({"lr": nested_aliases(4)}, "for this lm run write training.lr=[[[[...], ")):
        with pytest.raises(LMForgeError, match=re.escape(expected)) as e:
            load_config("go_coder_tiny", values=values)
        assert len(str(e.value)) < 500
    with pytest.raises(LMForgeError, match="overrides must be a list") as e:
        load_config("go_coder_tiny", "x" * 10**5)
    assert len(str(e.value)) < 500
    too_many = "the config holds more than 100,000 values"
    with pytest.raises(LMForgeError, match=too_many):
        load_config("go_coder_tiny", values={"model": {"preset": nested_aliases(6)}})  # no walk reaches gpt's check
    anchors = ["- &a0 [1, 2, 3, 4, 5, 6, 7, 8, 9]"]
    anchors += [f"- &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 7)]
    path = tmp_path / "bomb.yaml"
    path.write_text("anchors:\n  " + "\n  ".join(anchors) + "\nseed: *a6\n")
    with pytest.raises(LMForgeError, match=re.escape(f"{path}: {too_many}")):
        load_config(str(path))


@pytest.mark.parametrize("overrides, message", [
    ("training.max_steps=5", "overrides must be a list of \"KEY=VALUE\" strings, got the string "
                             "'training.max_steps=5': pass ['training.max_steps=5']"),
    ([5], "override 5 (int) is not a \"KEY=VALUE\" string"),
    (["name=x", None], "override None (NoneType) is not a \"KEY=VALUE\" string"),
])
def test_overrides_must_be_a_list_of_strings(overrides, message):
    with pytest.raises(LMForgeError, match=re.escape(message)):
        load_config("go_coder_tiny", overrides)


@pytest.mark.parametrize("name", ["", " ", "null", ".", "..", "a/b", "..\\x", "/abs"])
def test_a_run_name_that_is_not_a_directory_name_is_refused(name):
    """`name=` wrote checkpoints, config.yaml and metrics.jsonl straight into out_dir, among its runs."""
    with pytest.raises(LMForgeError, match="cannot name a run directory .*give a non-empty name without"):
        load_config("go_coder_tiny", [f"name={name}"])


def test_run_names_with_dots_dashes_and_underscores_are_kept():
    for name in ("run.v2", "my-run_2", "v1..2"):
        assert load_config("go_coder_tiny", [f"name={name}"]).name == name
