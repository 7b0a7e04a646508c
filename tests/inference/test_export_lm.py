"""A Hugging Face Llama folder exported as a prompt-continuation artifact
(``python -m flaxformer_lite.inference.export``, handed to ``export_lm``) and served by its
copied ``runtime.py`` in a subprocess that never imports flaxformer_lite: its continuations of
prompts of different lengths (left-padded into one call) equal ``LlamaForCausalLM.generate``'s,
ids and text.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the Llama reference runs in PyTorch (test extra)")
transformers = pytest.importorskip("transformers", reason="LlamaForCausalLM is the reference")

from flaxformer_lite.decoding.generation_config import GenerationConfig  # noqa: E402
from flaxformer_lite.inference import export, export_lm  # noqa: E402
from flaxformer_lite.interop import hf  # noqa: E402

from helpers.hf_llama import (
    DECODING_QK_GAIN,
    EOS,
    llama_config,
    prompts,
    random_llama,
    word_tokenizer,
)

MAX_NEW = 8
TEXTS = ["t5 t6 t7", "t9", "t40 t41 t42 t43 t44 t45 t46 t47 t48 t49 t50 t51 t52 t53 t54 t55 t56"]

SERVE = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import runtime
    model = runtime.load(sys.argv[1])
    rows = json.loads(sys.argv[2])
    out = {"ids": model.continue_ids(rows, batch_size=4)}
    out["text"] = model.complete(json.loads(sys.argv[3]))
    out["flaxformer_lite_imported"] = any(m.startswith("flaxformer_lite") for m in sys.modules)
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    root = tmp_path_factory.mktemp("export_lm")
    model = random_llama(llama_config(), seed=7, qk_gain=DECODING_QK_GAIN)
    model.save_pretrained(root / "folder")
    word_tokenizer(root / "folder")
    argv = ["--workdir", str(root / "folder"), "--out", str(root / "artifact")]
    assert export.main([*argv, "--method", "greedy", "--max-len", str(MAX_NEW)]) == 0
    return model, root / "folder", root / "artifact"


def hf_continuations(model, ids, mask) -> list[list[int]]:
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.from_numpy(ids),
            attention_mask=torch.from_numpy(mask),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            pad_token_id=EOS,
        )
    rows = [[int(t) for t in r] for r in out[:, ids.shape[1] :]]
    return [r[: r.index(EOS)] if EOS in r else r for r in rows]


def test_runtime_continues_as_generate_without_flaxformer_lite(artifact):
    model, folder, out = artifact
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kind"] == "lm" and manifest["max_len"] == MAX_NEW
    assert manifest["prepend_bos"] is False and manifest["tokenizer"] is True
    ids, mask = prompts(np.random.default_rng(3), 10, 9, side="left")
    rows = [[int(t) for t in r[m == 1]] for r, m in zip(ids, mask, strict=True)]
    served = subprocess.run(
        [sys.executable, "-c", SERVE, str(out), json.dumps(rows), json.dumps(TEXTS)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result = json.loads(served.stdout.splitlines()[-1])
    assert not result["flaxformer_lite_imported"]
    want = hf_continuations(model, ids, mask)
    assert result["ids"] == want
    assert len({tuple(r) for r in want}) > 3  # the prompts decide the continuations
    # Text: the folder's tokenizer (BOS first) in, its decoding out, as transformers'.
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), padding_side="left")
    tokenizer.pad_token = tokenizer.eos_token  # as Llama's: none of its own
    batch = tokenizer(TEXTS, padding=True, return_tensors="np")
    new = hf_continuations(model, batch["input_ids"], batch["attention_mask"])
    assert result["text"] == tokenizer.batch_decode(new, skip_special_tokens=True)


def test_what_cannot_be_exported_is_refused(artifact):
    _, folder, _ = artifact
    config, params, _ = hf.load_pretrained(str(folder))
    cases = [
        (GenerationConfig(method="sample", max_len=4), "method must be one of"),
        (GenerationConfig(max_len=None), "max_len must be an int"),
        (GenerationConfig(max_len=config.max_len - 1), "leave no prompt room"),
    ]
    for generation, message in cases:
        with pytest.raises(ValueError, match=message):
            export_lm.max_prompt_len(config, generation)
