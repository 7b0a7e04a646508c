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
    """The README's "Reuse a module" block, then its generate block, run as written."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    reuse = [b for b in blocks if "dot_product_attention(" in b and "EncoderDecoder(" in b]
    decode = [b for b in blocks if "generate(" in b and "GenerationConfig(" in b]
    assert len(reuse) == 1 and len(decode) == 1, "README: one reuse block, one generate block"
    namespace: dict = {}
    exec(reuse[0], namespace)  # attention and masks alone, one linen layer, a whole model
    assert namespace["out"].shape == (2, 6, 4, 16)
    assert namespace["weights"].shape == (2, 4, 6, 6)
    assert namespace["y"].shape == (2, 6, 64)
    assert namespace["logits"].shape == (2, 4, 8000)
    exec(decode[0], namespace)  # beam search over the same model
    assert namespace["tokens"].shape == (2, 32)
    assert namespace["scores"].shape == (2,)
