"""``aftlab export``: a trained run as a Hugging Face transformers folder (aftlab.hf)."""

from __future__ import annotations

import argparse
import sys

from ..errors import UsageError
from .commands import add_command, check_out_dir


def add_export(sub) -> None:
    p = add_command(
        sub,
        "export",
        cmd_export,
        help="write a run's language model as a Hugging Face transformers folder",
        description="Write the newest checkpoint of a language-model run as a save_pretrained "
        "folder (config.json, model.safetensors), loadable with "
        "transformers.AutoModelForCausalLM.from_pretrained after `import aftlab.hf`; a "
        "byte-level text run (text, enwik8, text8) also gets its tokenizer (tokenizer.json: "
        "id = byte), for AutoTokenizer and pipeline. Needs pip install 'aftlab[hf]'; see "
        "docs/huggingface.md.",
        epilog="example: aftlab export runs/text-aft-local-20260101-120000 hf/aft-local",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a folder written by aftlab train")
    p.add_argument("out_dir", metavar="OUT_DIR", help="a new (or empty) folder to write")


def cmd_export(args: argparse.Namespace) -> int:
    check_out_dir(args.out_dir, arg="OUT_DIR")
    try:
        from ..hf import export_run
    except ImportError as e:  # says how to install the hf extra
        raise UsageError(f"{e} (needed by aftlab export)") from None
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the output is the one line naming OUT_DIR
    out = export_run(args.run_dir, args.out_dir)
    print(out)
    if not (out / "tokenizer.json").is_file():
        print(
            "aftlab: note: no tokenizer.json written: the run's task is not byte-level text "
            "(its ids are not bytes); feed the model token ids",
            file=sys.stderr,
        )
    return 0
