"""tophatctl/edge_pipeline.py: a layer partition turned into the verifier's stages and hop links."""

import pytest

from tophatctl.edge_pipeline import stage_wiring


def test_device_zero_keeps_layers_past_the_draft_split_as_a_local_stage():
    wiring = stage_wiring([(0, 4), (4, 6), (6, 8)], [1.0, 3.0, 3.0], draft_layers=2, lan="lan")
    assert wiring.stage_layers == [(2, 4), (4, 6), (6, 8)]
    assert wiring.stage_devices == [0, 1, 2]
    assert wiring.stage_slowdowns == [1.0, 3.0, 3.0]
    # main (device 0) -> stage on device 0: no link; then device 0 -> 1 -> 2 -> back to device 0 over the LAN
    assert wiring.hop_links == ["none", "lan", "lan", "lan"]
    env = wiring.verifier_env()
    assert env["TOPHAT_VERIFIER_PIPELINE_STAGES"] == "3"
    assert env["TOPHAT_VERIFIER_STAGE_LAYERS"] == "2-4,4-6,6-8"
    assert env["TOPHAT_VERIFIER_STAGE_LINKS"] == "none;lan;lan;lan"


def test_device_zero_with_only_the_draft_layers_has_no_local_stage():
    wiring = stage_wiring([(0, 2), (2, 5), (5, 8)], [1.0, 3.0, 3.0], draft_layers=2, lan="lan")
    assert wiring.stage_layers == [(2, 5), (5, 8)]
    assert wiring.stage_devices == [1, 2]
    assert wiring.hop_links == ["lan", "lan", "lan"]


@pytest.mark.parametrize(
    "layers, m",
    [
        ([(0, 1), (1, 8)], 2),  # device 0 cannot draft from layer 2
        ([(0, 3), (4, 8)], 2),  # a gap
        ([(0, 8)], 2),  # one device
        ([(0, 2), (2, 8)], 8),
    ],
)
def test_bad_partitions_are_refused(layers, m):
    with pytest.raises(ValueError):
        stage_wiring(layers, [1.0] * len(layers), draft_layers=m, lan="lan")


def test_a_stored_plan_for_other_devices_or_another_lan_is_refused(tmp_path):
    from shared.jupiter.plan import build_plan, parse_edge_pipeline, parse_lan
    from shared.jupiter.profile import Profile
    from tests.conftest import DEMO_MODEL_DIR
    from tophatctl.edge_pipeline import edge_plan

    lengths, prefixes = (1, 128), (0,)
    profile = Profile(
        "demo",
        8,
        256,
        3_147_776,
        1024,
        8_388_608,
        8_389_632,
        lengths,
        prefixes,
        tuple((1e-3 + 20e-6 * s,) for s in lengths),
    )
    path = build_plan(profile, parse_edge_pipeline("orin;xavier"), *parse_lan("lan"), draft_layers=2, max_len=64).save(
        tmp_path / "plan.json"
    )
    assert edge_plan(DEMO_MODEL_DIR, "orin;xavier", "lan", "jupiter", 2, str(path)).stage_layers[0][0] == 0
    for spec, lan in (("orin;orin", "lan"), ("orin;xavier:512MiB", "lan"), ("orin;xavier", "10mbit,lat=5ms")):
        with pytest.raises(ValueError):
            edge_plan(DEMO_MODEL_DIR, spec, lan, "jupiter", 2, str(path))
