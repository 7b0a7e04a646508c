"""Bad inputs to the CLIs and the decoding API fail at once, before any loading or tracing.

Every case must end with one error line that names the argument and says what is valid, a
non-zero exit (argparse's 2) or a ValueError, and nothing read, loaded or written. Loading
and decoding are replaced by functions that fail the test if reached, so the tests need no
trained workdir and compile nothing.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from flaxformer_lite.cli import attention_maps, evaluate, translate
from flaxformer_lite.decoding import generate
from flaxformer_lite.inference import translator as inference
from flaxformer_lite.nn.config import TransformerConfig

CONFIG = TransformerConfig(
    vocab_size=16,
    d_model=16,
    num_heads=2,
    d_ff=32,
    num_encoder_layers=1,
    num_decoder_layers=1,
    dropout_rate=0.0,
    max_len=12,
)


def _reached(*args, **kwargs):
    raise AssertionError("the bad argument was not caught before loading / tracing")


@pytest.fixture
def no_work(monkeypatch):
    """Loading a workdir, decoding and jitted generation all fail the test if reached."""
    monkeypatch.setattr(inference.Translator, "from_workdir", _reached)
    monkeypatch.setattr(inference, "generate", _reached)
    monkeypatch.setattr(generate, "generate_jit", _reached)
    monkeypatch.setattr(generate, "continue_prompt_jit", _reached)


@pytest.fixture
def files(tmp_path):
    """A readable source file, a folder, and paths in a folder that does not exist."""
    source = tmp_path / "src.txt"
    source.write_text("1 2 3\n")
    folder = tmp_path / "folder"
    folder.mkdir()
    return {
        "source": str(source),
        "folder": str(folder),
        "missing_file": str(tmp_path / "absent.txt"),
        "in_missing_folder": str(tmp_path / "no_such_folder" / "out.txt"),
    }


def error_line(main, argv, capsys) -> str:
    """Runs a CLI ``main(argv)``; asserts exit code 2 and returns its one error line."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    # argparse: the usage line(s), then exactly one "prog: error: ..." line.
    errors = [line for line in err if ": error: " in line]
    assert len(errors) == 1 and err[-1] == errors[0], err
    return errors[0].split(": error: ", 1)[1]


# ----------------------------------------------------------------------------- translate


def test_translate_input_that_is_a_folder(no_work, files, capsys):
    out = Path(files["source"]).with_name("hyp.txt")
    argv = ["--workdir", "run", "--input", files["folder"], "--output", str(out)]
    line = error_line(translate.main, argv, capsys)
    assert line.startswith(f"argument --input: {files['folder']} is a folder; give a text file")
    assert not out.exists()


def test_translate_input_that_does_not_exist(no_work, files, capsys):
    line = error_line(
        translate.main, ["--workdir", "run", "--input", files["missing_file"]], capsys
    )
    assert line.startswith(f"argument --input: {files['missing_file']} does not exist")


def test_translate_output_in_a_missing_folder(no_work, files, capsys):
    argv = ["--workdir", "run", "--input", files["source"], "--output", files["in_missing_folder"]]
    line = error_line(translate.main, argv, capsys)
    assert line.startswith("argument --output: folder ") and "does not exist" in line
    assert "no_such_folder" in line


def test_translate_output_that_is_a_folder(no_work, files, capsys):
    argv = ["--workdir", "run", "--input", files["source"], "--output", files["folder"]]
    line = error_line(translate.main, argv, capsys)
    assert line == f"argument --output: {files['folder']} is a folder; give a file name"


# Line 3 holds a Latin-1 byte (0xff, "ÿ"): not UTF-8. Byte 3 of that line, the file's 11th.
NOT_UTF8 = b"one\ntwo\nth\xffree\nfour\n"
NOT_UTF8_PROBLEM = (
    "line 3: byte 3 (0xff) is not UTF-8; convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)"
)


def test_translate_input_that_is_not_utf8_names_the_file_and_line(no_work, tmp_path, capsys):
    bad, out = tmp_path / "test.en", tmp_path / "test.hyp"
    bad.write_bytes(NOT_UTF8)
    line = error_line(
        translate.main, ["--workdir", "run", "--input", str(bad), "--output", str(out)], capsys
    )
    assert line == f"argument --input: {bad} {NOT_UTF8_PROBLEM}"
    assert not out.exists()


def test_translate_stdin_that_is_not_utf8_names_the_line(no_work, monkeypatch, capsys):
    # stdin is read once the model has loaded (a bad --workdir must not wait for input): a
    # stand-in model, which nothing past the read may use.
    monkeypatch.setattr(
        inference.Translator, "from_pretrained", staticmethod(lambda *args, **kwargs: None)
    )
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(NOT_UTF8)))
    line = error_line(translate.main, ["--workdir", "run"], capsys)
    assert line == f"argument --input: stdin {NOT_UTF8_PROBLEM}"


def test_evaluate_files_that_are_not_utf8_name_the_flag_file_and_line(
    no_work, files, tmp_path, capsys
):
    bad = tmp_path / "test.de"
    bad.write_bytes(NOT_UTF8)
    good = files["source"]
    for flag, source, reference in [("--source", bad, good), ("--reference", good, bad)]:
        argv = ["--workdir", "run", "--source", str(source), "--reference", str(reference)]
        assert (
            error_line(evaluate.main, argv, capsys) == f"argument {flag}: {bad} {NOT_UTF8_PROBLEM}"
        )


@pytest.mark.parametrize(
    "data,line,byte,value",
    [
        (b"\xff", 1, 1, 0xFF),  # the first byte of the first line
        (
            b"ok\n\xc3\xa9\xe9t\xc3\xa9\n",
            2,
            3,
            0xE9,
        ),  # after a 2-byte character: bytes, not characters
        (b"a\nb\n\n\xe2\x82", 4, 1, 0xE2),  # a multi-byte character cut off at the end
        (b"a\r\nb\x80\r\n", 2, 2, 0x80),  # a lone continuation byte; "\r" is no line end
    ],
)
def test_decode_utf8_names_the_line_and_byte(data, line, byte, value):
    with pytest.raises(translate.NotUtf8Error) as info:
        translate.decode_utf8(data, "f.txt")
    assert str(info.value).startswith(
        f"f.txt line {line}: byte {byte} (0x{value:02x}) is not UTF-8;"
    )
    assert isinstance(info.value, ValueError)
    assert translate.decode_utf8("ü\n€".encode(), "f.txt") == "ü\n€"


@pytest.mark.parametrize(
    "flag,value,valid",
    [
        ("--beam_size", "0", "an int >= 1"),
        ("--batch_size", "-4", "an int >= 1"),
        ("--max_len", "0", "an int >= 1"),
        ("--average", "0", "an int >= 1"),
        ("--step", "-1", "an int >= 0"),
        ("--temperature", "-0.5", "a number >= 0"),
        ("--top_k", "-1", "an int >= 0"),
        ("--top_p", "0", "a number in (0, 1]"),
        ("--top_p", "nan", "a number in (0, 1]"),
    ],
)
def test_decoding_flags_out_of_range(no_work, files, capsys, flag, value, valid):
    argv = ["--workdir", "run", "--input", files["source"], flag, value]
    line = error_line(translate.main, argv, capsys)
    assert line.startswith(f"argument {flag}: must be {valid}")
    # evaluate shares the flags and the checks
    argv = ["--workdir", "run", "--source", files["source"], "--reference", files["source"]]
    assert error_line(evaluate.main, [*argv, flag, value], capsys) == line


# ----------------------------------------------------------------------------- evaluate


def test_evaluate_path_errors_name_the_flag(no_work, files, capsys):
    src, folder = files["source"], files["folder"]
    base = ["--workdir", "run", "--source", src, "--reference", src]
    cases = [
        (["--workdir", "run", "--source", folder, "--reference", src], "--source", "is a folder"),
        (
            ["--workdir", "run", "--source", src, "--reference", files["missing_file"]],
            "--reference",
            "does not exist",
        ),
        ([*base, "--output", files["in_missing_folder"]], "--output", "does not exist"),
        ([*base, "--report", folder], "--report", "is a folder"),
        ([*base, "--output", f"{folder}/h.txt", "--report", f"{folder}/h.txt"], "--report",
         "also --output"),
    ]  # fmt: skip
    for argv, flag, problem in cases:
        line = error_line(evaluate.main, argv, capsys)
        assert line.startswith(f"argument {flag}: ") and problem in line, line
    # A bad --report is found before anything is decoded, so --output is never written either.
    argv = [*base, "--output", folder + "/hyp.txt", "--report", files["in_missing_folder"]]
    assert error_line(evaluate.main, argv, capsys).startswith("argument --report: folder ")
    assert not (Path(folder) / "hyp.txt").exists()


# ----------------------------------------------------------------------------- attention_maps


def test_attention_maps_out_that_is_a_file(no_work, files, capsys):
    argv = ["--workdir", "run", "--text", "1 2", "--out", files["source"]]
    line = error_line(attention_maps.main, argv, capsys)
    assert line == f"argument --out: {files['source']} is a file; give a folder for the PNG files"
    assert Path(files["source"]).read_text() == "1 2 3\n"  # untouched


@pytest.mark.parametrize(
    "extra,flag", [(["--text", "  "], "--text"), (["--text", "1", "--max_len", "0"], "--max_len")]
)
def test_attention_maps_text_and_max_len(no_work, files, capsys, extra, flag):
    argv = ["--workdir", "run", "--out", files["folder"], *extra]
    assert error_line(attention_maps.main, argv, capsys).startswith(f"argument {flag}: ")


# ----------------------------------------------------------------------------- decoding API


def test_generate_max_len_beyond_the_model_positions(no_work):
    inputs = np.ones((2, 5), np.int32)
    with pytest.raises(ValueError, match=r"^max_len=13 .*max_len=12\): give max_len <= 12$"):
        generate.generate(None, CONFIG, inputs, max_len=13)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="^max_len must be a positive int or None"):
            generate.generate(None, CONFIG, inputs, max_len=bad)


def test_generate_row_max_len_shape_and_range(no_work):
    inputs = np.ones((2, 5), np.int32)
    with pytest.raises(ValueError, match=r"^row_max_len must be ints \[batch\] = \(2,\)"):
        generate.generate(None, CONFIG, inputs, max_len=6, row_max_len=[3, 3, 3])
    with pytest.raises(ValueError, match=r"^row_max_len values must be in \[1, max_len=6\]"):
        generate.generate(None, CONFIG, inputs, max_len=6, row_max_len=[3, 7])


def test_continue_prompt_beyond_the_cache(no_work):
    prompt = np.ones((2, 4), np.int32)  # BOS + 4 prompt tokens: 7 of 12 positions left
    with pytest.raises(ValueError, match=r"^max_len=8 .*4-token prompt.*give max_len <= 7$"):
        generate.continue_prompt(None, CONFIG, prompt, max_len=8)
    with pytest.raises(ValueError, match=r"^prompt of 11 tokens leaves no room.*at most 10"):
        generate.continue_prompt(None, CONFIG, np.ones((1, 11), np.int32))


def test_translator_max_len_beyond_the_model_positions(no_work):
    import jax

    from flaxformer_lite.data.tasks.synthetic import SymbolVocabulary

    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map(
        lambda s: rng.normal(0.0, 0.3, s.shape).astype(s.dtype),
        inference.Translator.abstract_params(CONFIG),
    )
    translator = inference.Translator(params, CONFIG, SymbolVocabulary("0123456789"))
    with pytest.raises(ValueError, match=r"^max_len=13 .*give max_len <= 12$"):
        translator.translate(["1 2 3"], max_len=13)
    with pytest.raises(ValueError, match=r"^max_len=13 "):
        translator.attention("1 2 3", max_len=13)


# ----------------------------------------------------------------------------- gs:// paths


def test_bucket_paths_are_checked_like_local_ones(gcs, no_work, capsys):
    from etils import epath

    epath.Path("gs://bucket/cli/src.txt").write_text("1 2 3\n")
    src, hyp = "gs://bucket/cli/src.txt", "gs://bucket/cli/new/hyp.txt"
    # A readable object, and an output under a "folder" that has no object yet: both fine
    # (object stores create folders with their objects).
    args = translate.parse_args(["--workdir", "run", "--input", src, "--output", hyp])
    assert (args.input, args.output) == (src, hyp)
    line = error_line(
        translate.main, ["--workdir", "run", "--input", "gs://bucket/cli/no.txt"], capsys
    )
    assert line.startswith("argument --input: gs://bucket/cli/no.txt does not exist")
    line = error_line(translate.main, ["--workdir", "run", "--input", "gs://bucket/cli"], capsys)
    assert line.startswith("argument --input: gs://bucket/cli is a folder")
    epath.Path("gs://bucket/cli/bad.txt").write_bytes(NOT_UTF8)
    line = error_line(
        translate.main, ["--workdir", "run", "--input", "gs://bucket/cli/bad.txt"], capsys
    )
    assert line == f"argument --input: gs://bucket/cli/bad.txt {NOT_UTF8_PROBLEM}"
    argv = ["--workdir", "run", "--input", src, "--output", "gs://bucket/cli"]
    assert error_line(translate.main, argv, capsys).startswith(
        "argument --output: gs://bucket/cli is a folder"
    )
    argv = ["--workdir", "run", "--text", "1", "--out", src]
    assert error_line(attention_maps.main, argv, capsys).startswith(
        f"argument --out: {src} is a file"
    )
