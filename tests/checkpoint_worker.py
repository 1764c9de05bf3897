"""Runs `MaxText.train.main` with the async save of one step frozen just before it completes.

    python tests/checkpoint_worker.py <step> configs/base.yml key=value ...

orbax writes a step into `<step>.orbax-checkpoint-tmp` and makes it complete by renaming it to
`<step>`. This worker replaces that final rename, for `<step>` only, by a line
`FROZEN SAVE <step>` on stdout and a sleep, so that a test can `kill -9` the process while the
save is written but not finalized (training goes on meanwhile, on the main thread).
Used by tests/test_checkpointing.py only.
"""

from __future__ import annotations

import sys
import time


def main() -> int:
    frozen_step = sys.argv[1]
    from orbax.checkpoint._src.path import atomicity

    from MaxText.train import main as train_main

    real_finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize(self):
        if self._final_path.name == frozen_step:
            print(f"FROZEN SAVE {frozen_step}", flush=True)
            while True:
                time.sleep(60)
        return await real_finalize(self)

    atomicity.AtomicRenameTemporaryPath.finalize = finalize
    return train_main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
