"""``OpRow.export`` is each registry row's export rule, looked up in ``fxq.export`` (the
registry itself does not import ``fxq.export``)."""

from __future__ import annotations

import pytest

from fxq import registry
from fxq.export import build, moves
from fxq.registry import Kind


@pytest.mark.parametrize("row", registry.ROWS, ids=lambda row: row.name)
def test_row_export_is_the_rule_to_graph_uses(row):
    if row.integer is not None:
        assert row.export is build.record_calls
    elif row.kind is Kind.PASSTHROUGH:
        assert row.export is not None
        assert row.export is (moves.value_rule(row.name) or moves._movement)
    else:
        assert row.export is None
