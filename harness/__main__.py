"""``python -m harness`` (usually under torchrun)."""

import sys

from torch.distributed.elastic.multiprocessing.errors import record

from harness.commands.main import main


@record
def _entry() -> int:
    return main()


if __name__ == "__main__":
    sys.exit(_entry())
