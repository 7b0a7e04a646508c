"""The package stays light to import, and the README's example runs as written."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_loads_only_jax_flax_numpy():
    code = "import sys, flaxformer_lite; print(sorted({m.split('.')[0] for m in sys.modules}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(eval(out.stdout))  # a printed list of module names
    assert {"jax", "flax", "numpy"} <= loaded
    heavy = {"optax", "orbax", "datasets", "sentencepiece", "matplotlib", "torch", "sacrebleu"}
    assert not (heavy & loaded), heavy & loaded


def test_readme_example_runs():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert len(blocks) >= 2
    namespace: dict = {}
    exec(blocks[0], namespace)  # build, jit-apply, attention and masks alone
    assert namespace["logits"].shape == (1, 4, 8000)
    assert namespace["out"].shape == (2, 6, 4, 16)
    assert namespace["weights"].shape == (2, 4, 6, 6)
    assert [w["self"].shape for w in namespace["per_layer"]] == [(1, 4, 6, 6)] * 3
    exec(blocks[1], namespace)  # generate with beam search
    assert namespace["tokens"].shape == (1, 32)
