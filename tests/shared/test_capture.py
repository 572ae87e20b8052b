"""The verifier's capture (shared/capture.py, TOPHAT_VERIFIER_CAPTURE_PATH): it records exactly the hidden-state
frames the cloud accepted, bitwise in the wire dtype, in order, and nothing it refused or that is not a hidden
state. The device side of a real HAT session (prompt chunks, speculative drafts) runs against the real
VerifierServer on a loopback WebSocket; a Cloud wrapper records what the device sent, and the capture must equal it.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import torch
from websockets.asyncio.client import connect

from services.device_agent.cloud_client import WebSocketCloud
from services.verifier_cloud.token_mode import TokenModel
from shared.capture import MAGIC, CaptureFormatError, CaptureWriter, read_capture
from shared.runtime import build_device_model
from shared.specdec.decode_loop import generate
from shared.specdec.device_session import DeviceSession, DraftConfig
from shared.specdec.sampling import SamplingParams
from shared.wire import schema as wire
from tests.mesh_tools import split_identity, verifier_on_loopback

M = 2
WIRE_TORCH = {wire.WireDtype.F16: torch.float16, wire.WireDtype.BF16: torch.bfloat16, wire.WireDtype.F32: torch.float32}


class RecordingCloud:
    """The device's Cloud, noting (kind, start, shallow in the wire dtype) of every frame once it is sent."""

    def __init__(self, inner: WebSocketCloud, session_id: int, sent: list):
        self.inner, self.session_id, self.sent = inner, session_id, sent

    def _note(self, kind: str, start: int, shallow: torch.Tensor) -> None:
        self.sent.append((self.session_id, kind, start, shallow.detach().to(WIRE_TORCH[self.inner.wire_dtype]).clone()))

    async def open(self, session_id):
        await self.inner.open(session_id)

    async def send_prefill(self, session_id, start_pos, shallow, is_last):
        answer = await self.inner.send_prefill(session_id, start_pos, shallow, is_last)
        self._note("prefill", start_pos, shallow)
        return answer

    async def send_verify(self, session_id, commit_len, shallow):
        answer = await self.inner.send_verify(session_id, commit_len, shallow)
        self._note("verify", commit_len, shallow)
        return answer

    async def verify(self, session_id, commit_len, shallow):
        return await (await self.send_verify(session_id, commit_len, shallow))  # the same frame as inner.verify

    async def close(self, session_id):
        await self.inner.close(session_id)


@pytest.fixture(scope="module")
def device_model(demo_checkpoint):
    return build_device_model(demo_checkpoint, M, None)  # with the checkpoint's draft adapter: drafts get accepted


def test_the_capture_is_exactly_what_the_device_sent(demo_checkpoint, device_model, tmp_path, caplog):
    capture = tmp_path / "capture.bin"
    prompt = demo_checkpoint.tokenizer.encode("def fibonacci(n):\n    return", add_special_tokens=False)
    sent: list = []
    accepts: list[int] = []

    async def main():
        async with verifier_on_loopback(demo_checkpoint, M, capture_path=str(capture)) as (server, url):
            # two sessions on two connections, each in its own wire dtype, at the same time
            runs = []
            for session_id, dtype in ((7, wire.WireDtype.F16), (8, wire.WireDtype.BF16)):
                inner = WebSocketCloud(
                    url,
                    demo_checkpoint.hidden_size,
                    wire_dtype=dtype,
                    request_timeout_s=30,
                    **split_identity(demo_checkpoint, M),
                )
                session = DeviceSession(device_model, prompt, SamplingParams(), DraftConfig(eta=0.2, max_draft=4), 20)
                options = {"parallel_candidates": 2, "parallel_steps": 2} if session_id == 8 else {}
                runs.append(
                    (
                        inner,
                        session,
                        generate(session, RecordingCloud(inner, session_id, sent), session_id, chunk_size=4, **options),
                    )
                )
            await asyncio.gather(*(run for _, _, run in runs))
            for inner, session, _ in runs:
                accepts.extend(session.accept_lengths)
                await inner.close_connection()

    with caplog.at_level(logging.WARNING, logger="services.verifier_cloud"):
        asyncio.run(main())
    assert any("CAPTURE ON" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)

    frames = read_capture(capture)
    for session_id in (7, 8):
        got = [f for f in frames if f.session_id == session_id]
        want = [s for s in sent if s[0] == session_id]
        kinds = [f.kind for f in got]
        assert kinds.count("prefill") == -(-len(prompt) // 4) and "verify" in kinds  # chunked prompt, then drafts
        assert [(f.kind, f.start) for f in got] == [(kind, start) for _, kind, start, _ in want]
        for frame, (_, _, _, shallow) in zip(got, want, strict=True):
            assert frame.rows.dtype == shallow.dtype and frame.rows.shape == shallow.shape
            assert torch.equal(frame.rows.view(torch.uint8), shallow.view(torch.uint8))  # bitwise
        assert [f.seq_no for f in got] == sorted({f.seq_no for f in got})  # accepted in the order sent
    assert {f.rows.dtype for f in frames} == {torch.float16, torch.bfloat16}
    assert max(accepts) > 1  # some drafts were accepted: the verify frames carried real multi-row drafts
    assert any(f.kind == "verify" and f.rows.shape[0] > 1 for f in frames)


def test_refused_token_and_fork_frames_are_not_recorded_and_forked_sessions_states_are(demo_checkpoint, tmp_path):
    capture = tmp_path / "capture.bin"
    hidden = demo_checkpoint.hidden_size
    identity = split_identity(demo_checkpoint, M)

    async def roundtrip(ws, message, wire_dtype=None):  # None: the tensor's own dtype goes on the wire
        await ws.send(wire.encode(message, wire_dtype=wire_dtype))
        return wire.decode(await asyncio.wait_for(ws.recv(), 10))

    async def main():
        async with verifier_on_loopback(
            demo_checkpoint, M, token_model=TokenModel(demo_checkpoint, M), full_model=True, capture_path=str(capture)
        ) as (_, url):
            async with connect(url) as ws:
                assert await roundtrip(ws, wire.OpenSession(1, hidden, **identity)) == wire.SessionOpened(1)
                refused = [
                    wire.PrefillChunk(1, 1, 0, True, torch.randn(3, hidden + 1)),  # wrong hidden size
                    wire.PrefillChunk(1, 2, 0, True, torch.full((3, hidden), float("nan"))),  # not finite
                    wire.PrefillChunk(99, 3, 0, True, torch.randn(3, hidden)),  # unknown session
                ]
                for message in refused:
                    assert isinstance(await roundtrip(ws, message), wire.ErrorFrame)
                probe = await roundtrip(ws, wire.BandwidthProbe(0, 4, 1, torch.randn(2, hidden)))
                assert isinstance(probe, wire.ProbeReply)  # padding, not a session's states
                prompt = torch.randn(3, hidden)
                assert isinstance(await roundtrip(ws, wire.PrefillChunk(1, 5, 0, True, prompt)), wire.DeepHidden)
                # a fork carries no states; the forked session's own frames are states the cloud sees
                assert await roundtrip(ws, wire.ForkSession(2, 1, 3)) == wire.SessionOpened(2)
                draft = torch.randn(2, hidden)
                reply = await roundtrip(ws, wire.VerifyRequest(2, 6, 3, draft), wire.WireDtype.BF16)
                assert isinstance(reply, wire.VerifyResult)
                # token mode: token ids, never recorded; and a hidden-state frame on it is refused
                assert await roundtrip(ws, wire.OpenTokenSession(3)) == wire.SessionOpened(3)
                assert not isinstance(await roundtrip(ws, wire.TokenPrefill(3, 7, [5, 6, 7])), wire.ErrorFrame)
                refused_on_token = await roundtrip(ws, wire.PrefillChunk(3, 8, 3, True, torch.randn(1, hidden)))
                assert isinstance(refused_on_token, wire.ErrorFrame)
        return prompt, draft

    prompt, draft = asyncio.run(main())
    frames = read_capture(capture)
    assert [(f.session_id, f.seq_no, f.kind, f.start) for f in frames] == [(1, 5, "prefill", 0), (2, 6, "verify", 3)]
    assert frames[0].rows.dtype == torch.float32 and torch.equal(frames[0].rows, prompt)  # as sent: f4
    assert torch.equal(frames[1].rows, draft.to(torch.bfloat16))  # as sent: bf


def test_capture_off_writes_no_file(demo_checkpoint, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    hidden = demo_checkpoint.hidden_size

    async def main():
        async with verifier_on_loopback(demo_checkpoint, M) as (server, url):
            assert server.capture is None
            async with connect(url) as ws:
                await ws.send(wire.encode(wire.OpenSession(1, hidden, **split_identity(demo_checkpoint, M))))
                await asyncio.wait_for(ws.recv(), 10)
                await ws.send(wire.encode(wire.PrefillChunk(1, 2, 0, True, torch.randn(2, hidden))))
                assert isinstance(wire.decode(await asyncio.wait_for(ws.recv(), 10)), wire.DeepHidden)

    asyncio.run(main())
    assert list(tmp_path.iterdir()) == []


def write_capture(path: Path, count: int) -> list[torch.Tensor]:
    writer = CaptureWriter.open(path)
    rows = [torch.randn(i + 1, 8).to(torch.bfloat16) for i in range(count)]
    for i, r in enumerate(rows):
        writer.record(1, i + 1, "prefill" if i == 0 else "verify", 10 * i, r)
    writer.close()
    return rows


@pytest.mark.parametrize("cut", [1, 3, 20])
def test_a_truncated_capture_gives_its_complete_records_and_a_typed_error(tmp_path, cut):
    path = tmp_path / "capture.bin"
    rows = write_capture(path, 3)
    assert [torch.equal(f.rows, r) for f, r in zip(read_capture(path), rows, strict=True)] == [True] * 3
    path.write_bytes(path.read_bytes()[:-cut])  # a crash mid-write: the last record is cut off
    with pytest.raises(CaptureFormatError) as caught:
        read_capture(path)
    assert caught.value.truncated
    assert [(f.seq_no, f.kind, f.start) for f in caught.value.frames] == [(1, "prefill", 0), (2, "verify", 10)]
    assert all(torch.equal(f.rows, r) for f, r in zip(caught.value.frames, rows[:2]))


def test_damaged_or_foreign_files_are_typed_errors_and_appending_keeps_old_records(tmp_path):
    foreign = tmp_path / "notes.txt"
    foreign.write_bytes(b"hello, not a capture\n")
    with pytest.raises(CaptureFormatError) as caught:
        read_capture(foreign)
    assert not caught.value.truncated and caught.value.frames == []
    with pytest.raises(CaptureFormatError):
        CaptureWriter.open(foreign)  # never appends records to a file that is not a capture
    assert foreign.read_bytes() == b"hello, not a capture\n"

    path = tmp_path / "capture.bin"
    write_capture(path, 2)
    write_capture(path, 1)  # a restarted verifier appends
    assert [f.seq_no for f in read_capture(path)] == [1, 2, 1]
    data = bytearray(path.read_bytes())
    data[len(MAGIC) + 4] ^= 0xFF  # the first record's msgpack header
    path.write_bytes(bytes(data))
    with pytest.raises(CaptureFormatError) as caught:
        read_capture(path)
    assert not caught.value.truncated and caught.value.frames == []


def test_a_failed_write_ends_the_capture_without_raising(tmp_path, caplog):
    path = tmp_path / "capture.bin"
    writer = CaptureWriter.open(path)
    writer.record(1, 1, "prefill", 0, torch.ones(1, 4, dtype=torch.float16))

    class FullDisk:
        def write(self, data):
            raise OSError(28, "No space left on device")

        def close(self):
            pass

    writer._file = FullDisk()  # the disk fills up under the verifier
    with caplog.at_level(logging.ERROR, logger="shared.capture"):
        writer.record(1, 2, "verify", 1, torch.ones(1, 4, dtype=torch.float16))
        writer.record(1, 3, "verify", 2, torch.ones(1, 4, dtype=torch.float16))  # no gap: nothing after a failure
    assert writer.failed and not writer.is_open and writer.records == 1
    assert "capture stopped" in caplog.text
    assert [f.seq_no for f in read_capture(path)] == [1]
