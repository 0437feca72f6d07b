from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import yaml

from fafo_cli import config as config_mod
from fafo_cli.config import Config
from fafo_cli.errors import FafoError


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_default_yaml_is_the_defaults():
    keys, data = set(Config().to_dict()), {}
    for line in config_mod.default_yaml().splitlines():  # each key's line, uncommented
        if line.startswith("# ") and line[2:].split(":")[0] in keys:
            data.update(yaml.safe_load(line[2:]))
    assert config_mod.build(**{k: v for k, v in data.items() if v is not None}) == Config()
    assert set(data) == keys


def test_the_file_config_init_writes_sets_nothing_until_a_key_is_uncommented(tmp_path):
    from fafo_cli.bench.tune import write_settings

    text = config_mod.default_yaml()
    assert yaml.safe_load(text) is None and "# max_tokens: 512" in text  # (fafo serve: no limit of 512 from it)
    path = write(tmp_path, text)
    write_settings(path, {"streams": 3})  # as `bench --tune` and `doctor --write` set what they measured
    written = path.read_text()
    assert yaml.safe_load(written) == {"streams": 3} and "\nstreams: 3\n" in written and "# streams:" not in written
    assert written.index("streams: 3") < written.index("# ngram:")  # in place, under its description


def test_file_then_flags(tmp_path):
    path = write(tmp_path, "max_tokens: 99\ntemperature: 0.5\nseed: 3\n")
    config = config_mod.resolve(str(path), temperature=0.9)
    assert (config.max_tokens, config.temperature, config.seed) == (99, 0.9, 3)
    opted_in = write(tmp_path, "trust_remote_code: true\nallow_pickle: true\n")
    run = {flag.key: flag for flag in config_mod.flags("run")}  # --no-trust-remote-code, --no-allow-pickle
    config = config_mod.resolve(str(opted_in), trust_remote_code=run["trust_remote_code"].value(False),
                                allow_pickle=run["allow_pickle"].value(False))
    assert (config.trust_remote_code, config.allow_pickle) == (False, False)


def test_keys_that_must_fit_one_another_are_checked_once_the_flags_are_in(tmp_path):
    """A file's value that fits only beside a flag's (a larger budget) is not refused before the flag is read; a
    file whose keys do not fit one another is still named."""
    path = write(tmp_path, "triforce_chunk: 128\n")
    assert config_mod.resolve(str(path), triforce_budget=1024).triforce_budget == 1024
    for flags in ({}, {"model": "m", "top_k": None}):  # (a command's other flags do not unname it)
        with pytest.raises(FafoError, match=r"c.yaml: config key 'triforce_budget' \(256\) must hold two chunks"):
            config_mod.resolve(str(path), **flags)
    with pytest.raises(FafoError, match=r"^config key 'triforce_budget' \(280\) must hold two chunks"):
        config_mod.resolve(str(path), triforce_budget=280)


def test_the_server_reads_a_file_s_max_tokens_that_fits_only_beside_a_flag(tmp_path):
    """`fafo serve -c FILE --triforce-budget 1024`: the file's max_tokens read again (every request's limit)."""
    from fafo_cli.serve.server import default_max_tokens

    path = write(tmp_path, "triforce_chunk: 128\nmax_tokens: 99\n")
    config = config_mod.resolve(str(path), triforce_budget=1024)
    assert default_max_tokens(config, str(path), {"triforce_budget": 1024}) == 99


def test_user_config_file_is_read(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    (tmp_path / "fafo").mkdir()
    (tmp_path / "fafo" / "config.yaml").write_text("top_k: 40\n")
    assert config_mod.resolve(None).top_k == 40


def test_explicit_null_clears_a_nullable_key(tmp_path):
    base = Config(seed=5)
    assert config_mod.load_file(write(tmp_path, "seed:\n"), base).seed is None
    with pytest.raises(FafoError, match="'max_tokens' must not be empty"):
        config_mod.load_file(write(tmp_path, "max_tokens:\n"))


@pytest.mark.parametrize("text,message", [
    ("bogus: 1\n", "unknown config key 'bogus'"),
    ("base: 1\n", "unknown config key 'base'"),  # (build's own argument's name)
    ("dtype: fp8\n", "'dtype' must be one of auto, float32, bfloat16, float16"),
    ("max_tokens: 0\n", "'max_tokens' must be >= 1"),
    ("max_tokens: 1.5\n", "'max_tokens' must be an integer"),
    ("temperature: -0.1\n", "'temperature' must be >= 0.0"),
    ("top_p: 0\n", "'top_p' must be > 0.0"),
    ("top_p: 1.5\n", "'top_p' must be <= 1.0"),
    ("chat_template: maybe\n", "'chat_template' must be true or false"),
    ("temperature: .nan\n", "'temperature' must be a number"),
    ("- a\n- b\n", "must be a mapping"),
    ("a: [\n", "is not valid YAML"),
    ("budget: 0\n", "'budget' must be an integer >= 1 \\(tokens\\) or a fraction in \\(0, 1\\)"),
    ("budget: 1.5\n", "'budget' must be an integer >= 1"),
    ("budget: 1.0\n", "'budget' 1.0: a fraction of the prompt must be below 1 \\(all of it is compressor: none\\)"),
    ("budget: many\n", "'budget' must be a number of tokens or a fraction"),
    ("temperature: 1" + "0" * 400 + "\n", "'temperature' must be a number \\(got 1000000000"),
    ("max_tokens: 1" + "0" * 5000 + "\n", "holds a number of thousands of digits"),
    ('budget: "1' + '0' * 5000 + '"\n', "'budget' holds a number of thousands of digits"),  # (text in quotes)
    ('streams: "1' + '0' * 5000 + '"\n', "'streams' holds a number of thousands of digits"),
    ('seed: !!int ""\n', "holds a tagged value YAML cannot read \\(IndexError"),  # PyYAML's own readers fail
    ("seed: !!int abc\n", "holds a tagged value YAML cannot read \\(ValueError"),
    ("seed: !!int digits\n", "holds a tagged value YAML cannot read \\(ValueError"),
    ("chat_template: !!bool y\n", "holds a tagged value YAML cannot read \\(KeyError"),
    ("model: !!timestamp no\n", "holds a tagged value YAML cannot read \\(AttributeError"),
    ("seed: " + "[" * 3000 + "]" * 3000 + "\n", "nests too deeply to be a config"),
    ("compressor: quest\nbudget: 20\n", "too small for the quest compressor: it needs at least page_size \\+ "
                                         "refresh = 32"),
    ("compressor: h2o\nrecent: 64\nbudget: 64\n", "it needs at least recent \\+ 1 = 65"),
    # a quarter of the budget is kept for new tokens: at 42, window 32, no prompt position was chosen by its score
    ("compressor: snapkv\nbudget: 42\n", "it needs at least window \\+ 1 beside a quarter for new tokens = 43"),
    # (found at once, however wide: it was searched for a step at a time)
    ("compressor: snapkv\nwindow: 1000000000000\n", "beside a quarter for new tokens = 1333333333334"),
    ("kernel: 4\n", "'kernel' must be odd"),
    ("compressor: lz4\n", "'compressor' must be one of auto, none, stream, quest, snapkv, h2o"),
    ("streams: -1\n", "'streams' must be auto or an integer from 0 to 64 \\(got -1\\)"),
    ("streams: 65\n", "'streams' must be auto or an integer from 0 to 64"),
    ("streams: wide\n", "'streams' must be auto or an integer from 0 to 64 \\(got 'wide'\\)"),
    ("streams: true\n", "'streams' must be auto or an integer from 0 to 64"),
    ("copies: 17\n", "'copies' must be auto or an integer from 0 to 16 \\(got 17\\)"),
    ("temprature: 0.5\n", "unknown config key 'temprature' \\(did you mean 'temperature'\\?"),
    ("max_tokens: 3\nmax_tokens: 4\n", "not valid YAML \\(line 2\\): the key 'max_tokens' is given twice"),
    ("[a, b]: 1\n", "not valid YAML \\(line 1\\)"),
    ("max_tokens: 3\n\tseed: 4\n", "not valid YAML \\(line 2\\): a tab where YAML wants spaces"),
    ("max_tokens: 3\nsystem: a\x1bb\n", "not valid YAML \\(line 2\\): it holds the control character '\\\\x1b'"),
    ("a: b: c\n", "not valid YAML \\(line 1\\): mapping values are not allowed here"),
    ("device: on\n", "'device' must be text \\(got True, which YAML reads as true or false: put it in quotes\\)"),
    ("model: 2024-01-01\n", "'model' must be text \\(got 2024-01-01, which YAML reads as a date"),
    ("system: [" + "a, " * 500 + "b]\n", "'system' must be text \\(got \\['a', 'a', .{1,30}\\)$"),  # shortened
    ("chat_template_kwargs: [1]\n", "'chat_template_kwargs' must be a mapping of names to values \\(got \\[1\\]\\)"),
    ("chat_template_kwargs: '{\"a\": tru'\n", "'chat_template_kwargs' must be a JSON object \\(Expecting value"),
    ("chat_template_kwargs:\n  day: 2024-01-01\n", "'chat_template_kwargs' must hold JSON values \\(Object of "
                                                    "type date"),
    ("chat_template_kwargs:\n  1: x\n", "'chat_template_kwargs': 1 is not a name a template can read"),
    ("chat_template_kwargs:\n  enable-thinking: x\n", "'enable-thinking' is not a name a template can read"),
    ("chat_template_kwargs:\n  messages: []\n", "'messages' is fafo's to set, not a template variable"),
])
def test_bad_files_name_the_key(tmp_path, text, message):
    with pytest.raises(FafoError, match=message):
        config_mod.load_file(write(tmp_path, text))


def test_streams_auto_or_a_count(tmp_path):
    assert config_mod.Config().streams == "auto"
    assert config_mod.load_file(write(tmp_path, "streams: 3\n")).streams == 3
    assert config_mod.build(streams="auto").streams == "auto"
    assert config_mod.build(streams="2").streams == 2  # the flag's text
    # digits that are not ASCII ones (str.isdigit() takes "²", int() does not): one clear error, not a ValueError
    for key in ("streams", "copies"):
        with pytest.raises(FafoError, match=f"'{key}' must be auto or an integer"):
            config_mod.build(**{key: "²"})
        with pytest.raises(FafoError, match=f"'{key}' must be auto or an integer"):
            config_mod.load_file(write(tmp_path, f'{key}: "²"\n'))


def test_budget_tokens_or_fraction(tmp_path):
    assert config_mod.load_file(write(tmp_path, "budget: 0.1\n")).budget == 0.1
    assert config_mod.load_file(write(tmp_path, "budget: 300\n")).budget == 300
    assert config_mod.load_file(write(tmp_path, "budget: 300.0\n")).budget == 300
    # a fraction is resolved against the prompt, so the token minimum is checked per request
    assert config_mod.load_file(write(tmp_path, "compressor: quest\nbudget: 0.01\n")).budget == 0.01
    for window in range(1, 300):  # snapkv's least budget: the first B above window + 1 whose B - max(1, B // 4)
        least = config_mod.MIN_BUDGET["snapkv"](Config(window=window))[1]  # (kept for new tokens) exceeds the window
        assert least - max(1, least // 4) > window and (least == window + 2 or least - 1 - (least - 1) // 4 <= window)


def test_a_seed_of_minus_one_is_a_fresh_one_as_in_llama_cpp(tmp_path):
    assert config_mod.load_file(write(tmp_path, "seed: -1\n"), Config(seed=5)).seed is None
    assert config_mod.resolve(None, seed=-1).seed is None  # (`--seed -1`: its text read as -1 first)
    with pytest.raises(FafoError, match="'seed' must be >= 0"):
        config_mod.resolve(None, seed=-2)


def test_a_budget_flag_reads_tokens_and_fractions():
    # a flag's text: "1" is one token (not the fraction 1.0, which is refused), "0.25" a quarter of the prompt
    assert config_mod.resolve(None, budget="1", sink=0, compressor="stream").budget == 1
    assert config_mod.resolve(None, budget="0.25").budget == 0.25
    with pytest.raises(FafoError, match="'budget' 1.0: a fraction"):
        config_mod.resolve(None, budget="1.0")


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(FafoError, match="config file not found"):
        config_mod.load_file(tmp_path / "nope.yaml")
    with pytest.raises(FafoError, match="cannot read config file"):
        config_mod.load_file(tmp_path)  # a folder


def test_reference_page_is_generated_from_config():
    page = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
    assert page.read_text() == config_mod.reference_markdown(), \
        "regenerate it: fafo config show --markdown > docs/configuration.md"


@pytest.fixture(scope="module")
def commands():
    import typer

    from fafo_cli import cli

    return typer.main.get_command(cli.app).commands


def _sample(spec) -> Any:
    """A valid value of the key other than its default, as Config holds it."""
    if spec.metadata["switch"]:
        candidates = list(spec.metadata["switch"])
    elif spec.metadata["choices"]:
        candidates = list(spec.metadata["choices"])
    else:
        by_type = {"int": [3, 5, 2, 9, 17, 1, 0, 300], "float": [0.5], "bool": [False, True],
                   "str": ["some text", '{"enable_thinking":false}']}  # (the second: a JSON object's key)
        candidates = [value for name in spec.type.split(" | ") if name != "None" for value in by_type[name]]
    for value in candidates:
        try:
            if value != spec.default and config_mod.build(**{spec.name: value}):
                return value
        except FafoError:
            continue
    raise AssertionError(f"no valid sample value for {spec.name}")


def _spellings(flag, value) -> list[list[str]]:
    """Every way to give `value` on the command line: each alias, each side of an on/off pair."""
    if not flag.declarations:
        return [[str(value)]]
    if flag.kind is bool:
        on, _, off = flag.declarations[0].partition("/")
        is_on = value == flag.switch[0] if flag.switch else value
        return [[on if is_on else off]]
    return [[declaration, str(value)] for declaration in flag.declarations]


@pytest.mark.parametrize("command", config_mod.GENERATE)
@pytest.mark.parametrize("spec", fields(Config), ids=lambda spec: spec.name)
def test_every_key_is_a_flag_that_reaches_the_config(commands, command, spec):
    """Every key is offered by the commands that generate (none is held back), and what its flag parses
    becomes the key's value."""
    offered = {flag.key: flag for flag in config_mod.flags(command)}
    assert spec.name in offered
    flag = offered[spec.name]
    value = _sample(spec)
    for argv in _spellings(flag, value):
        required = ["--prompt", "prompt.txt"] if command == "run" else []
        parsed = commands[command].make_context(command, [*required, *argv]).params
        given = {key: offered[key].value(parsed[key]) for key in offered}
        assert getattr(config_mod.build(**given), spec.name) == value, argv
        assert config_mod.build(**{k: v for k, v in given.items() if k != spec.name}) == Config()


def test_flag_spellings():
    run = {flag.key: flag for flag in config_mod.flags("run")}
    shorts = {"max_tokens": "-n", "streams": "-W", "ngram": "-k", "guesses": "-G", "prefix": "-P", "budget": "-B",
              "draft_tokens": "-D", "temperature": "--temp",  # (llama.cpp's and mlx-lm's --temp)
              "chat_template_kwargs": "--chat-template-config"}  # (mlx-lm's)
    assert {key: flag.declarations[1] for key, flag in run.items() if len(flag.declarations) > 1} == shorts
    assert run["compile"].declarations == ("--compile/--no-compile",)
    assert (run["compile"].value(True), run["compile"].value(False), run["compile"].value(None)) == ("on", "off", None)
    assert run["copies"].declarations == ("--copies",)
    # an opt-in a config file gives is turned off for one command as a switch's is
    assert run["trust_remote_code"].declarations == ("--trust-remote-code/--no-trust-remote-code",)
    assert run["model"].declarations == ()  # the positional argument


@pytest.mark.parametrize("written,expected", [("on", "on"), ("off", "off"), ("true", "on"), ("false", "off"),
                                              ("auto", "auto")])
def test_yaml_booleans_are_the_on_off_choices(tmp_path, written, expected):
    """YAML reads `on`, `off`, `true`, `false` as booleans: for an on/off key they mean its two choices."""
    path = tmp_path / "c.yaml"
    path.write_text(f"compile: {written}\ncuda_graphs: {written}\n")
    config = config_mod.resolve(str(path))
    assert (config.compile, config.cuda_graphs) == (expected, expected)


def test_a_folder_where_the_user_config_goes_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    (tmp_path / "fafo" / "config.yaml").mkdir(parents=True)
    with pytest.raises(FafoError, match="cannot read config file .*config.yaml: Is a directory"):
        config_mod.resolve(None)


def test_a_user_config_link_to_nothing_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    (tmp_path / "fafo").mkdir()
    (tmp_path / "fafo" / "config.yaml").symlink_to(tmp_path / "dotfiles" / "fafo.yaml")
    with pytest.raises(FafoError, match=r"cannot read config file .*config.yaml: it links to .*dotfiles/fafo.yaml, "
                                        "which does not exist"):
        config_mod.resolve(None)


def test_an_empty_string_empties_a_key_that_may_be_empty(tmp_path, commands):
    assert config_mod.build(model="", system="").model is None
    with pytest.raises(FafoError, match="'method' must be one of"):
        config_mod.build(method="")
    # a number from the config file, emptied by a flag: the model's default again (the command line gives text)
    (tmp_path / "fafo.yaml").write_text("seed: 1\ntemperature: 0.7\ntop_k: 40\n")
    offered = {flag.key: flag for flag in config_mod.flags("run")}
    parsed = commands["run"].make_context("run", ["-p", "f", "--seed", "", "--temp", "", "--top-k", "8"]).params
    flags = {key: offered[key].value(parsed[key]) for key in ("seed", "temperature", "top_k")}
    config = config_mod.resolve(str(tmp_path / "fafo.yaml"), **flags)
    assert (config.seed, config.temperature, config.top_k) == (None, None, 8)
    for key, text, kind in (("seed", "1.5", "an integer"), ("temperature", "warm", "a number"),
                            ("top_p", "nan", "a number")):
        with pytest.raises(FafoError, match=f"^config key '{key}' must be {kind}, or empty for the default"):
            offered[key].value(text)
    with pytest.raises(FafoError, match="'temperature' must be a number"):  # text elsewhere (a request) is no number
        config_mod.build(temperature="0.7")


def test_window_settings_count_where_a_window_runs():
    from fafo_cli.errors import FafoError

    given = {"budget", "sink", "ngram", "guesses"}
    config_mod.check_given(config_mod.build(compressor="stream"), given, accelerator=False)  # named: W=1
    config_mod.check_given(config_mod.build(), given, accelerator=True)  # auto is wide on a GPU, with stream
    for config, accelerator in ((config_mod.build(), False), (config_mod.build(streams=0), True)):
        for key in given:
            with pytest.raises(FafoError, match=f"'{key}' sets FAFO's lookahead window, which does not run here"):
                config_mod.check_given(config, {key}, accelerator)
    # naming no compressor is what turns a config file's window off on a CPU: an effect, not refused
    config_mod.check_given(config_mod.build(compressor="auto"), {"compressor"}, accelerator=False)
    with pytest.raises(FafoError, match="'compressor' sets FAFO's lookahead window"):
        config_mod.check_given(config_mod.build(compressor="quest", streams=0), {"compressor"}, accelerator=False)
    with pytest.raises(FafoError, match="'sink' is a setting of the stream compressor"):
        config_mod.check_given(config_mod.build(compressor="h2o"), given, accelerator=True)
    assert config_mod.compressors_of(config_mod.SPECS["window"]) == ("snapkv", "h2o")
    with pytest.raises(FafoError, match="'attention' is a setting of the stream/quest/snapkv/h2o compressor, which "
                                        "the window does not use here \\(compressor: none\\)"):
        config_mod.check_given(config_mod.build(compressor="none"), {"attention"}, accelerator=False)


def test_draft_model_settings_count_where_a_draft_model_runs():
    from fafo_cli.errors import FafoError

    given = {"triforce_gamma1", "triforce_draft_cache"}
    config_mod.check_given(config_mod.build(method="triforce", draft_model="m"), given, accelerator=False)
    for key in given:
        with pytest.raises(FafoError, match=f"'{key}' sets TriForce's draft-model level, which runs only with a"):
            config_mod.check_given(config_mod.build(method="triforce"), {key}, accelerator=False)


def test_numbers_in_exponent_form_are_numbers(tmp_path):
    config = config_mod.load_file(write(tmp_path, "min_p: 1e-3\ntemperature: 2.5E-1\nbudget: 5e-2\n"))
    assert config.min_p == 0.001 and config.temperature == 0.25 and config.budget == 0.05
    assert config_mod.load_file(write(tmp_path, "budget: 1e3\n")).budget == 1000


def test_settings_are_written_in_place_of_the_values(tmp_path):
    from fafo_cli.bench.tune import write_settings

    path = write(tmp_path, '# mine\n"streams": 4  # keep this\nmax_tokens: 100\n')
    write_settings(path, {"streams": 2, "ngram": 4})
    assert path.read_text() == '# mine\n"streams": 2  # keep this\nmax_tokens: 100\nngram: 4\n'
    write_settings(write(tmp_path, "seed:  # none\n"), {"seed": 3, "streams": 2})  # an empty value; a new key
    assert path.read_text() == "seed: 3  # none\nstreams: 2\n"
    flow = write(tmp_path, "{max_tokens: 100}\n")
    with pytest.raises(FafoError, match=f"config file {flow} is one {{...}} mapping"):
        write_settings(flow, {"streams": 2})
    assert flow.read_text() == "{max_tokens: 100}\n" and sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


def test_chat_template_variables_from_a_file_a_flag_or_a_request(tmp_path):
    """A mapping in the YAML file, JSON text on the command line (llama.cpp's --chat-template-kwargs), a JSON object
    in a server request: kept as the same compact JSON text; an empty one is none."""
    written = config_mod.load_file(write(tmp_path, "chat_template_kwargs:\n  enable_thinking: false\n  depth: 2\n"))
    flag = config_mod.resolve(None, chat_template_kwargs=' {"enable_thinking": false, "depth": 2} ')
    request = config_mod.build(chat_template_kwargs={"enable_thinking": False, "depth": 2})
    assert written.chat_template_kwargs == flag.chat_template_kwargs == request.chat_template_kwargs
    assert config_mod.template_variables(written) == {"enable_thinking": False, "depth": 2}
    assert config_mod.build(chat_template_kwargs={}).chat_template_kwargs is None
    assert config_mod.template_variables(Config()) == {}
    hash(written)  # (a Config stays a value)
    # given over a file's: variable by variable, as llama.cpp's server merges a request's into its command line's;
    # an empty mapping adds none, a flag's empty text (or the file's null) leaves none
    over = config_mod.build(written, chat_template_kwargs={"depth": 3, "x": None})
    assert config_mod.template_variables(over) == {"enable_thinking": False, "depth": 3, "x": None}
    assert config_mod.build(written, chat_template_kwargs={}) == written
    assert config_mod.build(written, chat_template_kwargs="").chat_template_kwargs is None
    assert config_mod.load_file(write(tmp_path, "chat_template_kwargs:\n"), written).chat_template_kwargs is None
