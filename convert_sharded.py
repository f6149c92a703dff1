"""
Write a sharded checkpoint (the folder an FSDP run saves, out_dir/ckpt_sharded) as one ckpt.pt with model, optimizer
and train state, e.g. to resume without torch.distributed.checkpoint or for a tool that reads one file. sample.py,
export.py, hellaswag.py and init_from read the folder as it is.

$ python convert_sharded.py out/ckpt_sharded                 # writes out/ckpt.pt
$ python convert_sharded.py out/ckpt_sharded_best best.pt    # the best val loss's weights, to a file of your choice
"""
from __future__ import annotations

import sys

from configurator import exit_on_help
from nanogpt.errors import UserError, exit_on_user_error
from nanogpt.checkpoint_sharded import convert_to_single_file


def main(argv: list[str]) -> None:
    exit_on_help(argv, __doc__)
    if len(argv) not in (1, 2) or argv[0].startswith("-"):
        raise UserError("usage: python convert_sharded.py OUT_DIR/ckpt_sharded [OUT_FILE] (default OUT_DIR/ckpt.pt)")
    print(f"wrote {convert_to_single_file(*argv)}")


if __name__ == "__main__":
    exit_on_user_error(lambda: main(sys.argv[1:]))
