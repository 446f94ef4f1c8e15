"""Config errors end in one line that says what is wrong, where (the ``--config`` file and line, or the
flag) and the closest valid key, value or class; exit status 2; an earlier run folder is left untouched
(issue 19, family 1). Through the real CLI in-process (``run_cli`` and ``main``), plus the message reader on
jsonargparse messages captured from real runs."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from helpers import CONFIGS, run_cli

from lightning_rl.cli.config_errors import summarize
from lightning_rl.cli.config_lookup import locate, yaml_line
from lightning_rl.cli.error_report import parse_message
from lightning_rl.cli.main import main

GRPO = str(CONFIGS / "grpo.yaml")
FILES = {
    "typo.yaml": "model:\n  init_args:\n    sampling:\n      num_generatoins: 4\n",
    "wrongtype.yaml": "model:\n  init_args:\n    sampling:\n      num_generations: four\n",
    "literal.yaml": "model:\n  init_args:\n    objective:\n      aggregation: token_mean\n",
    "classpath.yaml": "model:\n  class_path: lightning_rl.algorithms.GRP0\n",
    "syntax.yaml": "model:\n  init_args:\n    sampling:\n      num_generations: 4\n     bad: [1, 2\n",
    "interp.yaml": "model:\n  init_args:\n    sampling:\n      max_new_tokens: ${model.init_args.nope}\n",
    "callbacks.yaml": ("trainer:\n  callbacks:\n    - class_path: lightning_rl.callbacks.LogSamples\n"
                       "      init_args:\n        num_sampels: 3\n"),
    # flat keys from before the option groups
    "old_flat.yaml": "model:\n  init_args:\n    temperature: 0.5\n",
    "old_kl.yaml": "model:\n  init_args:\n    objective:\n      kl_in_reward: true\n",
    "old_ppo.yaml": ("model:\n  init_args:\n    critic_optimizer:\n      class_path: torch.optim.AdamW\n"
                     "      init_args:\n        lr: 5.0e-4\n"),
    "old_dpo.yaml": "model:\n  init_args:\n    max_new_tokens: 8\n",
}
GROUPS = "takes its options in groups (see --print_config)"
# each wrong input: the command line, and what its last line of stderr must contain
CASES = {
    "unknown_key_inline": (["fit", "--config", GRPO, "--model.init_args.sampling.num_generatoins", "4"],
                           ["unknown key `model.init_args.sampling.num_generatoins`",
                            "on the command line: --model.init_args.sampling.num_generatoins",
                            "did you mean `num_generations`?"]),
    "unknown_key_yaml": (["fit", "--config", GRPO, "--config", "typo.yaml"],
                         ["unknown key `model.init_args.sampling.num_generatoins`", "in typo.yaml, line 4",
                          "did you mean `num_generations`?"]),
    "unknown_key_callback": (["fit", "--config", GRPO, "--config", "callbacks.yaml"],
                             ["`trainer.callbacks.init_args.num_sampels`", "in callbacks.yaml, line 5",
                              "did you mean `num_samples`?"]),
    "wrong_type_yaml": (["fit", "--config", GRPO, "--config", "wrongtype.yaml"],
                        ["`model.init_args.sampling.num_generations` = 'four'", "in wrongtype.yaml, line 4",
                         "expected an integer"]),
    "wrong_type_inline": (["fit", "--config", GRPO, "--data.init_args.batch_size", "lots"],
                          ["`data.init_args.batch_size` = 'lots'", "--data.init_args.batch_size",
                           "expected an integer"]),
    "literal_validate": (["validate", "--config", GRPO, "--config", "literal.yaml"],
                         ["`model.init_args.objective.aggregation` = 'token_mean'", "in literal.yaml, line 4",
                          "'token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum', "
                          "'seq-mean-token-sum-norm'", "did you mean 'token-mean'?"]),
    "class_path_yaml": (["fit", "--config", GRPO, "--config", "classpath.yaml"],
                        ["`model.class_path` = 'lightning_rl.algorithms.GRP0'", "in classpath.yaml, line 2",
                         "did you mean `lightning_rl.algorithms.GRPO`?"]),
    "class_path_predict": (["predict", "--config", GRPO, "--data.class_path",
                            "lightning_rl.data.PromptDataModul"],
                           ["`data.class_path`", "on the command line: --data.class_path",
                            "did you mean `lightning_rl.data.PromptDataModule`?"]),
    "os_system_model": (["fit", "--config", GRPO, "--model.class_path", "os.system"],
                        ["`model.class_path` = 'os.system'", "not a subclass of TrainedModule",
                         "lightning_rl.algorithms.{"]),
    "popen_callback": (["fit", "--config", GRPO, "--trainer.callbacks+", "subprocess.Popen"],
                       ["`trainer.callbacks.class_path` = 'subprocess.Popen'", "not a subclass of Callback"]),
    # jsonargparse accepts a function as a callable's class_path and would call os.system("touch pwned")
    "os_system_optimizer": (["fit", "--config", GRPO, "--model.init_args.optimizer.class_path", "os.system",
                             "--model.init_args.optimizer.init_args.command", "touch pwned"],
                            ["`model.init_args.optimizer.class_path` = 'os.system'",
                             "is a function, not a class"]),
    "yaml_syntax": (["fit", "--config", GRPO, "--config", "syntax.yaml"],
                    ["syntax.yaml, line 5", "invalid YAML"]),
    "interpolation": (["fit", "--config", GRPO, "--config", "interp.yaml"],
                      ["`model.init_args.sampling.max_new_tokens`", "in interp.yaml, line 4",
                       "model.init_args.nope"]),
    "unknown_flag": (["fit", "--config", GRPO, "--trainer.max_stepz", "3"],
                     ["--trainer.max_stepz", "did you mean --trainer.max_steps?"]),
    "subcommand": (["fitt", "--config", GRPO], ["'fitt'", "did you mean `fit`?"]),
    # a flat key from before the option groups: where it is now
    "moved_key_yaml": (["fit", "--config", GRPO, "--config", "old_flat.yaml"],
                       ["`model.init_args.temperature` (in old_flat.yaml, line 3) is now "
                        "`model.init_args.sampling.temperature`", f"lightning_rl.algorithms.GRPO {GROUPS}"]),
    "moved_key_inline": (["fit", "--config", GRPO, "--model.init_args.temperature", "0.5"],
                         ["`model.init_args.temperature` (on the command line: "
                          "--model.init_args.temperature) is now `model.init_args.sampling.temperature`"]),
    "moved_key_in_a_mapping": (["fit", "--config", str(CONFIGS / "ppo.yaml"), "--config", "old_ppo.yaml"],
                               ["`model.init_args.critic_optimizer` (in old_ppo.yaml, line ",
                                "is now `model.init_args.critic.optimizer`",
                                f"lightning_rl.algorithms.PPO {GROUPS}"]),
    "moved_key_dpo": (["fit", "--config", str(CONFIGS / "dpo.yaml"), "--config", "old_dpo.yaml"],
                      ["`model.init_args.max_new_tokens` (in old_dpo.yaml, line 3) is now "
                       "`model.init_args.validation.max_new_tokens`",
                       f"lightning_rl.algorithms.DPO {GROUPS}"]),
    # a trust-region option of the flat objective group, and a trust region given by its old name
    "moved_trust_region_option": (["fit", "--config", GRPO, "--model.init_args.objective.clip_high", "0.28"],
                                  ["`model.init_args.objective.clip_high` (on the command line: "
                                   "--model.init_args.objective.clip_high) is now "
                                   "`model.init_args.objective.trust_region.init_args.high` (of Clip, "
                                   "CISPO or ClipCov)"]),
    "moved_trust_region_flat": (["fit", "--config", GRPO, "--model.init_args.kl_cov_coef", "0.5"],
                                ["`model.init_args.kl_cov_coef`", "is now "
                                 "`model.init_args.objective.trust_region.init_args.coef` (of KLCov)"]),
    "trust_region_by_old_name": (["fit", "--config", GRPO, "--model.init_args.objective.trust_region",
                                  "soft_gate"],
                                 ["`model.init_args.objective.trust_region` = 'soft_gate'",
                                  "`class_path: lightning_rl.maths.trust_regions.SoftGate`"]),
    "kl_in_reward_old_value": (["fit", "--config", str(CONFIGS / "ppo.yaml"), "--config", "old_kl.yaml"],
                               ["`model.init_args.objective.kl_in_reward` = 'True' (in old_kl.yaml, line 4)",
                                "`kl_in_reward: FixedKL`"]),
    "kl_target_moved": (["fit", "--config", str(CONFIGS / "ppo.yaml"),
                         "--model.init_args.objective.kl_target", "0.1"],
                        ["is now `model.init_args.objective.kl_in_reward.init_args.target` (of AdaptiveKL)"]),
    "another_regions_option": (["fit", "--config", GRPO,
                                "--model.init_args.objective.trust_region.init_args.tau_pos", "2"],
                               ["`model.init_args.objective.trust_region.init_args.tau_pos`",
                                "lightning_rl.maths.trust_regions.Clip has no argument `tau_pos`"]),
}


def digest(root: Path) -> dict[str, str]:
    """Every path under ``root`` with its content's hash (folders: empty)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""
            for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """The config files above and a planted earlier run (``runs/lightning-rl/version_0``, the default
    logger's folder) with a checkpoint, an exported policy, a config and TensorBoard events."""
    root = tmp_path_factory.mktemp("config_errors")
    for name, text in FILES.items():
        (root / name).write_text(text)
    run = root / "runs" / "lightning-rl" / "version_0"
    for sub in ("checkpoints", "policy"):
        (run / sub).mkdir(parents=True)
    (run / "config.yaml").write_text((CONFIGS / "grpo.yaml").read_text())
    (run / "checkpoints" / "epoch=0-step=1.ckpt").write_bytes(os.urandom(4096))
    (run / "policy" / "model.safetensors").write_bytes(os.urandom(1024))
    (run / "events.out.tfevents.1.host").write_bytes(os.urandom(512))
    return root


@pytest.fixture
def planted(workdir, monkeypatch) -> Path:
    """Run in ``workdir``; afterwards the earlier run is byte-identical and no other run folder appeared."""
    monkeypatch.chdir(workdir)
    before = digest(workdir / "runs")
    yield workdir
    assert digest(workdir / "runs") == before
    assert not (workdir / "pwned").exists()


def last_error_line(capsys) -> tuple[str, str]:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    return (lines[-1] if lines else ""), err


@pytest.mark.parametrize("args, wanted", list(CASES.values()), ids=list(CASES))
def test_last_line_names_the_problem(args, wanted, planted, capsys):
    with pytest.raises(SystemExit) as exit_:
        run_cli(*args)
    last, err = last_error_line(capsys)
    assert exit_.value.code == 2
    assert last.startswith("lightning-rl: error: "), err
    for text in wanted:
        assert text in last, f"{text!r} not in the last line: {last}"
    assert "Given value" not in err and "usage:" not in err, err  # no dump (unless LRL_DEBUG=1)


def test_a_value_out_of_range_names_the_key_and_the_range(planted):
    with pytest.raises(ValueError, match=r"`model.sampling.temperature` must be > 0, got 0.0"):
        run_cli("fit", "--config", GRPO, "--model.init_args.sampling.temperature", "0")


def test_old_flat_key_is_one_line_naming_its_new_key(planted, capsys):
    """A YAML written for the flat keys stops before anything is built, on one line: the old key, the file
    and line, the new key."""
    with pytest.raises(SystemExit) as exit_:
        run_cli("fit", "--config", GRPO, "--config", "old_flat.yaml")
    last, err = last_error_line(capsys)
    assert exit_.value.code == 2
    assert last == ("lightning-rl: error: `model.init_args.temperature` (in old_flat.yaml, line 3) is now "
                    f"`model.init_args.sampling.temperature`: lightning_rl.algorithms.GRPO {GROUPS}"), err
    assert [line for line in err.splitlines() if "error" in line.lower()] == [last], err


def test_debug_keeps_the_full_report_above_the_line(planted, capsys, monkeypatch):
    monkeypatch.setenv("LRL_DEBUG", "1")
    with pytest.raises(SystemExit) as exit_:
        run_cli("fit", "--config", GRPO, "--model.init_args.sampling.num_generatoins", "4")
    last, err = last_error_line(capsys)
    assert exit_.value.code == 2
    # jsonargparse's own report of a key its group does not accept
    assert "usage:" in err and "unrecognized arguments: --sampling.num_generatoins=4" in err
    assert last.startswith("lightning-rl: error: unknown key `model.init_args.sampling.num_generatoins`")


def test_console_entry_point(planted, capsys, monkeypatch):
    """``lightning-rl`` itself (``main``): exit status 2, the answer on the last line. (A subprocess run shows
    the same; it costs ~10-25 s of start-up here, so the suite calls ``main`` in-process.)"""
    monkeypatch.delenv("LRL_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", GRPO, "--config", "typo.yaml"])
    last, err = last_error_line(capsys)
    assert exit_.value.code == 2
    assert "`model.init_args.sampling.num_generatoins` (in typo.yaml, line 4)" in last, err
    assert last.endswith("did you mean `num_generations`?")


# ----- the message reader, on messages jsonargparse 4.x printed in real runs of the cases above


def message(*lines: str) -> str:
    return "\n".join(lines)


UNKNOWN = message(
    'Parser key "model":',
    "  Does not validate against any of the Union subtypes",
    "  Subtypes: [<class 'lightning_rl.algorithms.base.PolicyModule'>, <class 'NoneType'>]",
    "  Errors:",
    "    - Problem with given class_path 'lightning_rl.algorithms.GRPO':",
    "        Option 'num_generatoins' is not accepted",
    "    - Expected a <class 'NoneType'>",
    "  Given value type: <class 'jsonargparse._util.NestedArg'>",
    "  Given value: NestedArg(key='num_generatoins', val='4')",
)
LITERAL = message(
    'Parser key "model":',
    "  Does not validate against any of the Union subtypes",
    "  Subtypes: [<class 'lightning_rl.algorithms.base.PolicyModule'>, <class 'NoneType'>]",
    "  Errors:",
    "    - Problem with given class_path 'lightning_rl.algorithms.GRPO':",
    '        Parser key "objective.aggregation":',
    "          Expected a typing.Literal['token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum',"
    " 'seq-mean-token-sum-norm']. Got value: token_mean",
    "    - Expected a <class 'NoneType'>",
    "  Given value type: <class 'dict'>",
    "  Given value: {'init_args': {'objective': {'aggregation': 'token_mean'}}}",
)
UNION = message(
    'Parser key "model":',
    "  Does not validate against any of the Union subtypes",
    "  Subtypes: [<class 'lightning_rl.algorithms.base.PolicyModule'>, <class 'NoneType'>]",
    "  Errors:",
    "    - Problem with given class_path 'lightning_rl.algorithms.GRPO':",
    '        Parser key "rewards.overlong_buffer":',
    "          Does not validate against any of the Union subtypes",
    "          Subtypes: [<class 'int'>, typing.Literal['auto'], <class 'NoneType'>]",
    "          Errors:",
    "            - Expected a <class 'int'>",
    "            - Expected a typing.Literal['auto']",
    "            - Expected a <class 'NoneType'>",
    "          Given value type: <class 'str'>",
    "          Given value: autoo",
    "    - Expected a <class 'NoneType'>",
    "  Given value type: <class 'jsonargparse._util.NestedArg'>",
    "  Given value: NestedArg(key='rewards.overlong_buffer', val='autoo')",
)
OPTIMIZER_OPTION = message(
    'Parser key "model":',
    "  Does not validate against any of the Union subtypes",
    "  Subtypes: [<class 'lightning_rl.algorithms.base.PolicyModule'>, <class 'NoneType'>]",
    "  Errors:",
    "    - Problem with given class_path 'lightning_rl.algorithms.GRPO':",
    '        Parser key "optimizer":',
    "          Type typing.Callable[[collections.abc.Iterable], torch.optim.optimizer.Optimizer] expects a"
    " function or a callable class: Option 'lrr' is not accepted. Got value: Namespace(class_path="
    "'torch.optim.AdamW', init_args=Namespace(lrr='1'))",
    "    - Expected a <class 'NoneType'>",
    "  Given value type: <class 'jsonargparse._util.NestedArg'>",
    "  Given value: NestedArg(key='optimizer.init_args.lrr', val='1')",
)
NOT_A_MODULE = message(
    'Parser key "model":',
    "  Does not validate against any of the Union subtypes",
    "  Subtypes: [<class 'lightning_rl.algorithms.base.PolicyModule'>, <class 'NoneType'>]",
    "  Errors:",
    "    - Import path os.system does not correspond to a subclass of PolicyModule",
    "    - Expected a <class 'NoneType'>",
    "  Given value type: <class 'jsonargparse._util.NestedArg'>",
    "  Given value: NestedArg(key='class_path', val='os.system')",
)
NO_CLASS = message(
    'Parser key "model":',
    "  Does not validate against any of the Union subtypes",
    "  Subtypes: [<class 'lightning_rl.algorithms.base.PolicyModule'>, <class 'NoneType'>]",
    "  Errors:",
    "    - Problem with given class_path 'lightning_rl.algorithms.GRP0':",
    "        module 'lightning_rl.algorithms' has no attribute 'GRP0'",
    "    - Expected a <class 'NoneType'>",
    "  Given value type: <class 'dict'>",
    "  Given value: {'class_path': 'lightning_rl.algorithms.GRP0'}",
)
NOT_A_CALLBACK = message(
    'Parser key "trainer.callbacks":',
    "",
    "  - Expected a path but subprocess.Popen either not accessible or invalid",
    "  - Does not validate against any of the Union subtypes",
    "  Subtypes: [list[lightning.pytorch.callbacks.callback.Callback], <class "
    "'lightning.pytorch.callbacks.callback.Callback'>, <class 'NoneType'>]",
    "  Errors:",
    "    - Import path does not correspond to a subclass of Callback",
    "    - Import path does not correspond to a subclass of Callback",
    "    - Expected a <class 'NoneType'>",
    "  Given value type: <class 'str'>",
    "  Given value: subprocess.Popen",
)


@pytest.mark.parametrize("text, kind, key, value, cls", [
    (UNKNOWN, "unknown_key", "model.init_args.num_generatoins", None, "lightning_rl.algorithms.GRPO"),
    (LITERAL, "type", "model.init_args.objective.aggregation", "token_mean", None),
    (UNION, "type", "model.init_args.rewards.overlong_buffer", "autoo", None),
    (OPTIMIZER_OPTION, "unknown_key", "model.init_args.optimizer.init_args.lrr", None, "torch.optim.AdamW"),
    (NOT_A_MODULE, "class_path", "model.class_path", "os.system", None),
    (NO_CLASS, "class_path", "model.class_path", "lightning_rl.algorithms.GRP0", None),
    (NOT_A_CALLBACK, "class_path", "trainer.callbacks.class_path", "subprocess.Popen", None),
    ("Subcommand 'fit' does not accept option 'trainer.max_stepz'", "unknown_key", "trainer.max_stepz", None,
     None),
], ids=["unknown", "literal", "union", "optimizer_option", "not_a_module", "no_class", "not_a_callback",
        "top_level"])
def test_parse_message(text, kind, key, value, cls):
    problem = parse_message(text)
    assert (problem.kind, problem.key, problem.value, problem.cls) == (kind, key, value, cls)


def test_parse_message_types_and_bases():
    assert parse_message(LITERAL).choices == ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                              "seq-mean-token-sum-norm"]
    union = parse_message(UNION)
    assert union.expected == ["an integer", "null"] and union.choices == ["auto"]
    assert parse_message(NOT_A_MODULE).base == "lightning_rl.algorithms.base.PolicyModule"
    assert parse_message(NOT_A_CALLBACK).base == "lightning.pytorch.callbacks.callback.Callback"


def test_summaries_without_a_source():
    """Messages alone (no file or flag sets the key): the problem and the suggestion, no location."""
    assert summarize(UNION, []) == (
        "lightning-rl: error: `model.init_args.rewards.overlong_buffer` = 'autoo': expected 'auto' or an "
        "integer or null; did you mean 'auto'?")
    assert summarize(OPTIMIZER_OPTION, []).endswith("AdamW has no argument `lrr`; did you mean `lr`?")
    assert summarize(NO_CLASS, []).endswith("did you mean `lightning_rl.algorithms.GRPO`?")
    assert "expected one of lightning_rl.algorithms.{" in summarize(NOT_A_MODULE, [])
    assert summarize("unrecognized arguments: --trainer.max_stepz 3", [], ["--trainer.max_steps"]).endswith(
        "unknown option --trainer.max_stepz (on the command line); did you mean --trainer.max_steps?")
    yaml_error = ('Problems parsing config: while parsing a block mapping\n  in "<unicode string>", line 2, '
                  'column 3\ndid not find expected key\n  in "<unicode string>", line 4, column 4')
    assert summarize(yaml_error, []).startswith("lightning-rl: error: invalid YAML in a value on the command")


def test_locate_in_files_and_flags(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "flat.yaml").write_text("model:\n  sampling:\n    num_generations: 2\n")  # init_args left out
    assert yaml_line("typo.yaml", "model.init_args.sampling.num_generatoins") == 4
    assert yaml_line("flat.yaml", "model.init_args.sampling.num_generations") == 3
    assert yaml_line("callbacks.yaml", "trainer.callbacks.init_args.num_sampels") == 5  # in a list
    assert yaml_line("wrongtype.yaml", "model.init_args.sampling.num_generations", "4") is None
    args = ["fit", "--config", GRPO, "--config", "wrongtype.yaml", "--model", "GRP0"]
    # the source that gives the value wins over a later one that sets the key
    assert locate("model.init_args.sampling.num_generations", args, "four") == "in wrongtype.yaml, line 4"
    assert locate("model.init_args.sampling.num_generations", args) == "in wrongtype.yaml, line 4"
    # `--model X` gives model.class_path, not the file's
    assert locate("model.class_path", args, "GRP0") == "on the command line: --model"
    assert locate("model.init_args.objective.kl_coef", ["--model.objective.kl_coef=x"], "x").endswith(
        "line: --model.objective.kl_coef")
    assert locate("data.init_args.batch_size", ["fit"]) == ""
