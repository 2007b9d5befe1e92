"""Write the bytecode the daemons load, once, as root, after a `pip install --no-compile`.

    python -m rlfleet.tools.precompile --model /opt/rlfleet/models/tiny-qwen2

The Ansible role runs this after installing rlfleet[ml] without pip's compile step. pip
compiles every module it installs (11,389 for rlfleet[ml]: 35 of the 48 s an install takes on a
2-core host) while this writes about 2,500 (rlfleet, its daemons and a Qwen2 model's code). They run as the rlfleet user, who cannot write
__pycache__ in the root-owned venv, so a module without bytecode would be compiled in memory at
every start; this writes it for what they load. rlfleet is compiled whole. The libraries are
compiled by importing them: each role's daemon module, what learners and engines import on
first use, and each model folder's architecture and tokenizer code. A module none of these
loads is compiled in memory when first used: a slower start, never a wrong one.
"""

from __future__ import annotations

import argparse
import compileall
import importlib
import sys
import time
from pathlib import Path

# rlfleet's packages, as the wheel holds them (pyproject.toml's package-dir), compiled whole.
PACKAGES = ("rlfleet.common", "rlfleet.daemons", "rlfleet.relay", "rlfleet.tools")
# Imported inside functions (on first use), so importing the daemon modules does not load them.
FIRST_USE_MODULES = (
    "torch",
    "torch.distributed",
    "torch.nn.functional",
    "safetensors.torch",
    "transformers",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
)


def daemon_modules() -> list[str]:
    from rlfleet.daemons import DAEMON_CLASSES, NODE_DAEMON_CLASSES
    return sorted({target.partition(":")[0] for target in {**DAEMON_CLASSES, **NODE_DAEMON_CLASSES}.values()})


def load_model_code(folder: Path) -> str:
    """Import the modelling and tokenizer modules of the model in `folder` (no weights are read)."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = AutoConfig.from_pretrained(str(folder))
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # the lookup imports its module
    AutoTokenizer.from_pretrained(str(folder))
    return f"{config.model_type} ({model_class.__name__})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlfleet.tools.precompile", description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", default=[], type=Path, metavar="DIR",
                        help="a model folder the daemons will load (repeatable)")
    args = parser.parse_args(argv)
    if sys.flags.dont_write_bytecode:
        parser.error("bytecode writing is off (PYTHONDONTWRITEBYTECODE or -B): nothing would be written")
    for folder in args.model:
        if not (folder / "config.json").is_file():
            parser.error(f"--model {folder}: no config.json there (a model folder has one)")
    start = time.monotonic()
    for name in PACKAGES:
        folder = importlib.import_module(name).__path__[0]
        if not compileall.compile_dir(folder, quiet=1, workers=0):
            print(f"precompile: a module of {folder} does not compile", file=sys.stderr)
            return 1
    for name in (*daemon_modules(), *FIRST_USE_MODULES):
        importlib.import_module(name)
    for folder in args.model:
        try:
            loaded = load_model_code(folder)
        except (OSError, ValueError, KeyError) as exc:
            print(f"precompile: the model in {folder} does not load: {exc}", file=sys.stderr)
            return 1
        print(f"precompile: {folder}: {loaded}")
    print(f"precompile: rlfleet, {len(sys.modules)} modules loaded by its daemons and models, "
          f"in {time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
