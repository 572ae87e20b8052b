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


@pytest.mark.parametrize("layers, m", [
    ([(0, 1), (1, 8)], 2),  # device 0 cannot draft from layer 2
    ([(0, 3), (4, 8)], 2),  # a gap
    ([(0, 8)], 2),  # one device
    ([(0, 2), (2, 8)], 8),
])
def test_bad_partitions_are_refused(layers, m):
    with pytest.raises(ValueError):
        stage_wiring(layers, [1.0] * len(layers), draft_layers=m, lan="lan")
