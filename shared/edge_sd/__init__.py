"""Edge SD (paper 001, Zhu et al.): a draft model on a small base station (SBS) drafts for many
users' tasks in batches, a target model on a macro base station (MBS) verifies them, and the two
stages are pipelined across batches.

Pure planning functions (no I/O), one module per concern:
- `runtime`: model shapes, FLOPs per forward pass (eqs. 11-14), draft memory (eqs. 9-10) and the
  runtime model T(b, F) = c1*F*b + c2 (eq. 17) with its least-squares fit.
- `speculation`: expected tokens per verification L (eq. 7), decoding steps n_m (eq. 8) and the
  enumeration of the speculation length l (problem P3, eq. 33).
- `batching`: Algorithm 1 (DP over batch boundaries of the input-sorted tasks, eqs. 28-32) with
  the pipeline recursion of eqs. 20-22, plus brute-force and max-batching baselines.
- `bandwidth`: the uplink bandwidth split (eqs. 25-27).
- `timeline`: the pipeline completion timeline (eq. 20) for comparison with measurements.
"""
