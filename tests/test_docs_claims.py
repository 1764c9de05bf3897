"""Small claims of docs/ that no other test pinned, each checked here where the docs cite it.
Cheap by design: nothing here compiles a program."""

from __future__ import annotations

import jax
import optax
import pytest
from engine_models import make_step, mpmd_mesh, tied_mlp_setup

import jaxpp_integration as jaxpp
from jaxpp_integration.compiler.reduction_plan import ReductionChoice


def test_marker_aliases_are_the_marker():
    """docs/engine.md: `mark_stage_end` and `pipeline_yield` are other names of the marker."""
    assert jaxpp.mark_stage_end is jaxpp.pipeline_enter_stage
    assert jaxpp.pipeline_yield is jaxpp.pipeline_enter_stage


def test_a_second_treduce_is_refused():
    """docs/engine.md, Known limits: one `treduce` per step; a second one is an error, raised
    while the step is traced and cut (before any XLA compile)."""
    params, batch, loss_fn = tied_mlp_setup(2, 4)
    one = make_step(loss_fn, optax.sgd(0.1), jaxpp.Std1F1B(2))

    def twice(params, opt_state, batch):
        params, opt_state, loss, grads = one(params, opt_state, batch)
        _, _, again, _ = one(params, opt_state, batch)
        return params, opt_state, loss + again, grads

    step = jaxpp.mpmd_jit_with_loop(twice, mpmd_mesh=mpmd_mesh(2))
    with pytest.raises(ValueError, match=r"needs exactly one treduce in the step fun\w+, found 2"):
        step.compile(params, optax.sgd(0.1).init(params), batch)


def test_the_gradient_reduction_log_line():
    """docs/engine.md, Collectives per step: the line the trainer logs for its choice
    (`reduction_choice.describe()`), on a device that reports no memory (CPU)."""
    choice = ReductionChoice(
        "auto", ("data",), ("fsdp",), state_bytes=2e9, full_partial_bytes=3e9, memory_bytes=None
    )
    assert choice.describe().startswith(
        "gradient_reduction=auto: sums over data deferred to once per step; over fsdp "
        "reduce-scattered into the shard every microbatch (device memory unknown; "
    )
    assert jax.devices()[0].memory_stats() is None  # why "unknown" is what CPU runs print


ONE_FAILS = """
import sys, time
if "process_id=0" in sys.argv:
    print("failing on purpose", flush=True)
    sys.exit(1)
time.sleep(120)
"""


def test_launch_prefixes_output_and_stops_the_others_when_one_fails(tmp_path, capsys):
    """docs/cluster.md, Starting the processes: `MaxText.launch` prefixes each line with
    `[pN]` and, when one process fails, stops the others (here one that would sleep 2 minutes)
    and returns the failed one's code."""
    import time

    from MaxText import launch

    child = tmp_path / "child.py"
    child.write_text(ONE_FAILS)
    start = time.monotonic()
    assert launch.launch(2, [], script=child, timeout=100) == 1
    assert time.monotonic() - start < 60  # the sleeping process was stopped, not waited for
    out = capsys.readouterr().out
    assert "[p0] failing on purpose" in out
    assert "[launch] process 0 exited with 1; stopping the others" in out


def test_the_unsupported_keys_table_is_the_modules():
    """docs/coming_from_maxtext.md's table of refused MaxText keys is a copy of
    `MaxText/config/unsupported_keys.py`: the same keys (and `decoder_block` values), each with
    the reason the config error gives. A key implemented (or refused) later changes both."""
    import re
    from pathlib import Path

    from MaxText.config.unsupported_keys import UNSUPPORTED, UNSUPPORTED_VALUES

    page = Path(__file__).resolve().parent.parent / "docs" / "coming_from_maxtext.md"
    table = page.read_text().split("## MaxText keys not supported here", 1)[1]
    documented = {}
    for row in table.splitlines():
        if row.startswith("| `"):
            names, why = (cell.strip() for cell in row.strip("|").split("|"))
            for name in re.findall(r"`([^`]+)`", names):
                documented[name] = why
    blocks = UNSUPPORTED_VALUES["decoder_block"]
    want = {**UNSUPPORTED, "decoder_block=": None, **blocks}
    assert sorted(documented) == sorted(want)
    assert {k: documented[k] for k in UNSUPPORTED} == UNSUPPORTED
    assert {k: documented[k] for k in blocks} == blocks
