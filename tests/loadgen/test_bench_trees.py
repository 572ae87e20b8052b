"""`tophat bench trees` (loadgen/bench_trees.py) on the demo model: every node budget decodes every prompt, in an
order rotated per prompt, and greedy output is the chain's (and the cloud's) in every shape."""

from __future__ import annotations

import json
from argparse import Namespace

from loadgen import bench_trees
from shared.specdec.device_session import DraftConfig


def test_every_budget_runs_every_prompt_in_rotated_order_with_the_chains_greedy_output(tmp_path, monkeypatch):
    order = []
    generate = bench_trees.generate

    async def recording(session, cloud, session_id):
        order.append((session_id, session.draft_config.tree_nodes))
        return await generate(session, cloud, session_id=session_id)

    monkeypatch.setattr(bench_trees, "generate", recording)
    config = DraftConfig()
    args = Namespace(
        nodes="0,4,8", tree_width=config.tree_width, tree_min_prob=config.tree_min_prob, rtt_ms=0.0, model="demo",
        adapter=None, split_layers=2, prompts=3, max_new_tokens=8, eta=config.eta, max_draft=config.max_draft,
        threads=1, dtype="f32", out=tmp_path / "trees.json",
    )  # fmt: skip
    rows = bench_trees.run(args)
    assert order == [(1, 0), (1, 4), (1, 8), (2, 4), (2, 8), (2, 0), (3, 8), (3, 0), (3, 4)]
    assert all(row["identical_to_chain"] for row in rows.values())
    assert all(rows[n]["rounds"] >= 3 for n in (0, 4, 8))  # every prompt's rounds, at least one each
    saved = json.loads(args.out.read_text())
    assert set(saved["budgets"]) == {"0", "4", "8", "cloud"}
