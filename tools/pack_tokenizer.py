#!/usr/bin/env python3
"""Pack a checkpoint's tokenizer into one fast-loading file (same as `dsv4 pack-tokenizer`).

Usage: tools/pack_tokenizer.py CHECKPOINT_DIR [OUT]
OUT defaults to CHECKPOINT_DIR/dsv4-tokenizer.pack. Exits 2 with `dsv4: <message>` when the
tokenizer does not match the checkpoint's config.json.
"""

import argparse
import sys
from pathlib import Path

# Run from a source tree without installing: the package sits next to tools/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    from dsv4stream.cli.tokenizer import describe
    from dsv4stream.errors import Dsv4Error
    from dsv4stream.text.tokenizer import Tokenizer, pack_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint_dir", type=Path)
    ap.add_argument("out", nargs="?")  # a str: a trailing / means a folder
    args = ap.parse_args(argv)
    try:
        path = pack_tokenizer(args.checkpoint_dir, args.out)
        print(describe(Tokenizer.load(path)))
    except Dsv4Error as e:
        print(f"dsv4: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
