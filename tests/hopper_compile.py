"""Compile the dilated Triton kernels, the merge kernels beside them, the split-KV decode kernel (its
pointer and tensor-descriptor loads) and the exchange's few-keys passes for sm_90 (Hopper) on a machine without
a GPU.

The CPU interpreter runs the kernels' Python and lets through what Triton's
compiler refuses (a reassigned constexpr, a call missing an argument), so
tests/test_dilated.py runs this in a subprocess without TRITON_INTERPRET:
``python tests/hopper_compile.py`` exits 0 when every variant compiles to
a cubin (the attention kernels' key or query tile loads pipelined
asynchronous copies, the decode kernel's descriptor loads bulk tensor
copies (TMA); the merge kernels have no tile loop),
prints ``skip: ...`` and exits 3 where this Triton has no CUDA backend to
compile with.

The arguments carry the divisibility a real launch gives them (Triton's
launcher marks pointers and integers divisible by 16): without it no load
is known to be 16-byte aligned, none is vectorised, and none is pipelined,
which is not what runs on the GPU.

``PTX_DIR=dir``: the decode kernel's variants' PTX is written there, for
``ptxas -arch=sm_90a -v`` (registers: two programs of 4 warps share an SM at
head dim > 64, four at 64, so at most 128 a thread there).
"""
import os
import sys
import warnings

warnings.filterwarnings("ignore")


def sig(fn, consts):
    ptr = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "DO": "*bf16", "DQ": "*bf16", "DK": "*bf16",
           "DV": "*bf16", "LSE": "*fp32", "DELTA": "*fp32", "CU": "*i32", "BR": "*i32"}
    return {n: "constexpr" if n in consts else ptr.get(n, "fp32" if n in ("qk_scale", "scale") else "i32")
            for n in fn.arg_names}


# integer arguments a LongNet launch passes as multiples of 16: strides, lengths, segment, sub-block
DIVISIBLE = {"SQ", "SK", "W", "INNER"}


def attrs(fn, signature):
    """The launcher's specialisation: pointers and multiples of 16 marked divisible by 16."""
    div = lambda n: signature[n].startswith("*") or n in DIVISIBLE or (n[0] == "s" and n[1:].islower())
    return {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
            if signature[n] != "constexpr" and div(n)}


def main():
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:
        print(f"skip: {e}")
        return 3
    from longattn.kernels import attention_jit as aj

    packed = lambda rates: sum(r << (15 * t) for t, r in enumerate(rates))
    base = dict(D=128, D_PAD=128, HAS_LEFT=False, HAS_RIGHT=False, VARLEN=False, IEEE=False, DILATED=True)
    variants = [  # (kernel, constants): a deduplicated branch, a weighted first branch, a plain branch
        (aj._fwd_kernel, dict(base, CAUSAL=False, DEDUP=True, NH=2, HR=packed([4, 8]), BLOCK_M=128, BLOCK_N=128,
                              MERGE=True)),
        (aj._dkdv_kernel, dict(base, CAUSAL=True, DEDUP=True, NH=1, HR=packed([8]), BLOCK_M=64, BLOCK_N=128,
                               ACCUM=True)),
        (aj._dq_kernel, dict(base, CAUSAL=True, DEDUP=False, NH=3, HR=packed([2, 4, 8]), BLOCK_M=128, BLOCK_N=64,
                             ACCUM=False)),
        (aj._fwd_kernel, dict(base, CAUSAL=True, DEDUP=False, NH=0, HR=0, BLOCK_M=128, BLOCK_N=128, MERGE=False)),
    ]
    from longattn.kernels import merge as km

    tile = dict(D=128, D_PAD=128, BLOCK=32)
    variants += [  # the carved flex call's merge and gradient sums (pointer types as it launches them)
        (km._stack_kernel, dict(tile, _ptr={"O": "*bf16", "L": "*fp32", "DST": "*bf16", "DL": "*fp32",
                                            "ROWS": "*i64"})),
        (km._sum_rows_kernel, dict(tile, _ptr={"G": "*bf16", "DST": "*bf16", "ROWS": "*i64"})),
    ]
    from longattn.kernels import decode as kd

    # the merge's step as DecodeTuning sets it at D=128, G=4, 4 warps (merge_floats_per_thread)
    dec = dict(G=4, D=128, D_PAD=128, BLOCK_M=16, ROWS=4, S_CHUNK=32, BLOCK_N=64, CAUSAL=False, PER_ROW=True,
               IEEE=False, HEADS_FAST=False, TRACE=False)
    dec_ptr = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "OP": "*fp32", "LP": "*fp32", "O": "*bf16", "L": "*fp32",
               "CNT": "*i32", "LENS": "*i32", "TR": "*bf16", "KD": "*bf16", "VD": "*bf16", "qk_scale": "fp32"}
    desc = dict(dec_ptr, KD="tensordesc<bf16[1,64,1,128]>", VD="tensordesc<bf16[1,64,1,128]>")
    variants += [  # a KVCache step's launch (lengths on the device), pointer loads, and descriptor loads with int32
        # and int64 lengths (the loop's key index then int64: the descriptors take 32-bit coordinates)
        (kd._split_kernel, dict(dec, DESC=False, _ptr=dec_ptr, _bulk=False)),
        # head dim 64, where 4 programs share an SM (128 registers a thread at most)
        (kd._split_kernel, dict(dec, D=64, D_PAD=64, DESC=False, _ptr=dec_ptr, _bulk=False)),
        (kd._split_kernel, dict(dec, DESC=True, _ptr=desc, _bulk=True)),
        (kd._split_kernel, dict(dec, DESC=True, CAUSAL=True, _ptr=dict(desc, LENS="*i64"), _bulk=True)),
        # a traced launch (benchmarks/decode_kernel_timeline.py): the timers' inline PTX assembles
        (kd._split_kernel, dict(dec, DESC=False, TRACE=True, _ptr=dict(dec_ptr, TR="*i64"), _bulk=False)),
    ]
    from longattn.kernels import few_keys as fk

    few = dict(GROUP=1, D=128, D_PAD=128, BM=fk.BLOCK_M, BN=fk.BLOCK_N, IEEE=False)
    few_ptr = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "DO": "*bf16", "DQ": "*bf16", "PS": "*bf16",
               "L": "*fp32", "DL": "*fp32", "scale": "fp32", "scale_log2": "fp32"}
    variants += [  # the exchange's few-keys passes (the row launches; dK/dV are cuBLAS GEMMs)
        (fk._fwd_merge, dict(few, _ptr=few_ptr)),
        (fk._bwd_rows, dict(few, HAS_DLSE=True, _ptr=few_ptr)),
        (fk._bwd_rows, dict(few, GROUP=4, HAS_DLSE=False, _ptr=few_ptr)),
    ]
    for fn, consts in variants:
        bulk = consts.pop("_bulk", None)
        ptr = consts.pop("_ptr", None)
        signature = sig(fn, consts) if ptr is None else {n: "constexpr" if n in consts else ptr.get(n, "i32")
                                                          for n in fn.arg_names}
        at = {i: a for i, a in attrs(fn, signature).items() if not signature[fn.arg_names[i[0]]].startswith("tensordesc")}
        src = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=at)
        warps = 4 if bulk is not None else 8  # the decode kernel's tiles (DecodeTuning: 64 keys, 4 warps)
        try:
            out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=3))
        except (RuntimeError, FileNotFoundError) as e:  # no ptxas / CUDA backend here
            if "ptxas" in str(e) or "backend" in str(e).lower():
                print(f"skip: {e}")
                return 3
            raise
        assert "cubin" in out.asm, fn.__name__
        if os.environ.get("PTX_DIR") and bulk is not None:  # for ptxas -v: the decode kernel's registers
            tag = "_".join(f"{k}{int(consts[k])}" for k in ("D", "DESC", "CAUSAL", "TRACE"))
            with open(os.path.join(os.environ["PTX_DIR"], f"{fn.__name__}_{tag}.ptx"), "w") as f:
                f.write(out.asm["ptx"])
        # the attention kernels' inner loops' tile loads pipelined (cp.async into shared memory, waited on stages
        # ahead)
        assert ptr is not None or "cp.async" in out.asm["ptx"], f"{fn.__name__}: no pipelined tile loads"
        if bulk is not None:  # the decode kernel: pipelined pointer loads, or bulk tensor copies where it has descriptors
            ptx = out.asm["ptx"]
            assert ("cp.async.bulk.tensor" in ptx) == bulk and "cp.async" in ptx, (fn.__name__, consts)
    print(f"compiled {len(variants)} kernel variants for sm_90")
    return 0


if __name__ == "__main__":
    sys.exit(main())
