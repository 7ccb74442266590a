"""``python -m harness`` (usually under torchrun)."""

from torch.distributed.elastic.multiprocessing.errors import record

from harness.commands.main import leave, process_main


@record
def _entry() -> int:
    return process_main()


if __name__ == "__main__":
    leave(_entry())
