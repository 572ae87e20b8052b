"""Serving modes as feature switches, parsed from short names.

HAT's baselines and ablations are combinations of a few independent mechanisms, so a
mode is a set of flags rather than a class per mode; the session process branches on
the flags. Each is a variant of a mode of shared/modes.py's table (cloud of `cloud`, the
rest of `hat`), and what it puts on the wire comes from that table. Names (comma-free,
so `--modes a,b,c` can list them):

    ushape          split, no SD, whole prompt uploaded at once, one token per round trip
    usarathi[-C]    ushape + the cloud cuts the uploaded prompt into C-token chunks run in
                    successive steps (no upload/compute overlap); C defaults to HAT's 128
                    for SpecBench and 256 for CNN/DM
    cloud           no split: token ids up, the whole model in the cloud (compute scaled by
                    Calibration.compute_scale), the cloud samples; one token per round trip,
                    like the real device agent's `mode=cloud` (token_decode)
    cloud-stream    the same, but the cloud decodes on its own and streams token ids down
                    (no round trips: a plain cloud LLM service)
    hat             SD + PC + PD; ``hat-sd``, ``hat-pc``, ``hat-sd-pc``, ``hat-sd-pd`` ... pick
                    switches (PD needs SD: it pre-drafts the next draft)
    hat-tree        hat drafting a tree every round (the calibration's measured trees, trees.py); no
                    parallel drafting around a tree, as on the device; ``tree`` is also a switch
    hat-budget      hat with the draft budget: before each round shared.planning.draft_budget's choose_budget
                    picks no drafts (a U-shape round), the chain, or the tree where the calibration
                    has one (loadgen/simulate/budget.py); ``budget`` is also a switch (``hat-sd-budget``;
                    it needs SD)
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.modes import MODE_TABLE

SARATHI_CHUNK = {"specbench": 128, "cnndm": 256}
HAT_SWITCHES = ("sd", "pc", "pd")
OPTIONAL_SWITCHES = ("budget", "tree")


@dataclass(frozen=True)
class SimMode:
    """A simulated serving mode: the switches the session process branches on."""

    name: str
    speculative: bool = False  # SD: draft k tokens, verify k+1 rows in one pass
    client_chunking: bool = False  # PC: eq. 3 chunks, uploads overlap cloud compute
    parallel_drafting: bool = False  # PD: pre-draft from top candidates during verification
    server_chunk: int | None = None  # U-Sarathi: server-side chunks of this many tokens
    token_upload: bool = False  # cloud: token ids on the wire, whole model in the cloud
    cloud_stream: bool = False  # cloud: decode in the cloud without a round trip per token
    draft_budget: bool = False  # SD rounds shaped by the draft budget (none, chain or tree, per round)
    tree_rounds: bool = False  # SD rounds draft the calibration's tree

    def __post_init__(self) -> None:
        if self.parallel_drafting and not self.speculative:
            raise ValueError(f"mode {self.name!r}: parallel drafting needs speculative decoding (sd)")
        if self.draft_budget and not self.speculative:
            raise ValueError(f"mode {self.name!r}: the draft budget needs speculative decoding (sd)")
        if self.tree_rounds and (self.draft_budget or not self.speculative):
            raise ValueError(f"mode {self.name!r}: trees need sd, and the budget offers its tree itself")
        if self.server_chunk is not None and self.server_chunk < 1:
            raise ValueError(f"mode {self.name!r}: server chunk must be >= 1")


def token_upload(table_mode: str) -> bool:
    """Whether a mode of shared/modes.py's table puts token ids on the wire (else hidden states)."""
    return MODE_TABLE[table_mode].uplink == "tokens"


def parse_mode(spec: str, workload: str = "specbench") -> SimMode:
    """A mode from its name (see the module docstring)."""
    name = spec.strip().lower()
    if name == "ushape":
        return SimMode(name, token_upload=token_upload("hat"))
    if name in ("cloud", "cloud-stream"):
        return SimMode(name, token_upload=token_upload("cloud"), cloud_stream=name == "cloud-stream")
    if name == "usarathi" or name.startswith("usarathi-"):
        _, _, size = name.partition("-")
        try:
            chunk = int(size) if size else SARATHI_CHUNK.get(workload, 128)
        except ValueError:
            raise ValueError(f"bad U-Sarathi chunk in {spec!r} (use usarathi-128)") from None
        return SimMode(name, server_chunk=chunk, token_upload=token_upload("hat"))
    if name == "hat" or name.startswith("hat-"):
        parts = name.split("-")[1:] or list(HAT_SWITCHES)
        if parts in (["budget"], ["tree"]):
            parts = [*HAT_SWITCHES, *parts]
        bad = [p for p in parts if p not in HAT_SWITCHES + OPTIONAL_SWITCHES]
        if bad:
            raise ValueError(
                f"unknown HAT switch(es) {bad} in {spec!r}; use {', '.join(HAT_SWITCHES + OPTIONAL_SWITCHES)}"
            )
        return SimMode(
            name,
            speculative="sd" in parts,
            client_chunking="pc" in parts,
            parallel_drafting="pd" in parts,
            token_upload=token_upload("hat"),
            draft_budget="budget" in parts,
            tree_rounds="tree" in parts,
        )
    raise ValueError(
        f"unknown mode {spec!r}; use ushape, usarathi[-C], cloud[-stream], "
        "hat[-sd][-pc][-pd][-budget|-tree], hat-budget, hat-tree"
    )


def parse_modes(text: str, workload: str = "specbench") -> list[SimMode]:
    modes = [parse_mode(part, workload) for part in text.split(",") if part.strip()]
    if not modes:
        raise ValueError("no modes given")
    return modes
