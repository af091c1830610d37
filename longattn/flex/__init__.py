"""The engines of the flex ops (:func:`longattn.flex_attention`,
:func:`longattn.ring_flex_attention`): any attention pattern given as
FlexAttention ``mask_mod`` / ``score_mod`` on global positions.

* :mod:`.checks` — the arguments, checked at the public call;
* :mod:`.plan` — a mask reduced to FlexAttention block masks per ring step
  (empty, full, partial blocks; the steps a rank needs); pure functions;
* :mod:`.step` — the local op (:class:`~.step.FlexStep`) and its compile cache;
* :mod:`.schedule` — the executors of a call, cached per (shape, pattern):
  one step on one device, the ring schedule across ranks;
* :mod:`.autograd` — the ring's autograd (its backward loop), and the call where no query sees a key;
* :mod:`.blocks` — each named pattern's FlashAttention-4 form: exact block
  sparsity at FA4's tiles and the one mask body (no FA4 import);
* :mod:`.fa4` — FA4 with that form: the kernel choice (``explain_flex``), the
  one-device call and each ring step's executor; the only module that reaches
  into FA4's mask internals.
* :mod:`.exchange` — the other engine of ``ring_flex_attention`` (``engine=``):
  sparse K/V halos and heavy query rows shipped to the keys' rank in place of
  the ring, chosen where it moves a fraction of the ring's bytes
  (``tuning.FLEX_EXCHANGE``); its executors in :mod:`.pieces`, run by
  :mod:`.exchange_run`.

The ring is :mod:`longattn.distributed.ring` with one call per step whose
executor runs FlexAttention on (local queries x the visiting K/V block) under
that step's block mask: empty blocks are skipped by the kernel, empty steps
are not computed (their exchange still runs), and the ring ends after the
last step any rank needs. Partial results merge by lse in float32 as in
every ring.

Backward. On one device FlexAttention's own autograd runs. In the ring each
step's forward records FlexAttention's autograd graph of its block but keeps
none of the tensors that graph saves (``saved_tensors_hooks``): q, the K/V
block, the block's out and lse are dropped as they are saved, and the
backward supplies them again, with the MERGED out and lse of all blocks in
place of the block's. FlexAttention's backward with the merged softmax
statistics gives the block's exact share of dQ, dK, dV (P = exp(S - L) and
delta = rowsum(dO * O) - dL over all keys, as a single-device backward uses
for each key block), so no forward is recomputed and no cotangent pass runs;
the graph holds only the block mask's tensors and small buffers, and the K/V
blocks come back round the ring (:func:`.autograd.ring_grads`, which says
what it holds at its peak). (Keeping each step's graph with its tensors would
keep every visiting K/V block: memory O(seqlen) instead of O(seqlen / ranks).)
"""
