"""First fast decode with an empty Triton cache, with and without hashing Triton's own key
ahead of the warm-up (``kernels.backend.start_compiler_key``). One case per process.

usage: python3 first.py TREE CASE on|off
"""
import os
import statistics
import sys
import tempfile


def main(tree: str, case_name: str, mode: str) -> None:
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="fvd-first-")
    import torch

    from fast_vae_decode.bench.cases import select_cases
    from fast_vae_decode.bench.comfyui import comfyui_path, setup_comfyui
    from fast_vae_decode.bench.subjects import build_subject
    from fast_vae_decode.bench.timing import timed_call

    if mode == "off":
        import fast_vae_decode.fastpath.fused as fused
        import fast_vae_decode.fastpath.prewarm as prewarm

        def skip() -> None:
            return None

        fused.start_compiler_key = prewarm.start_compiler_key = prewarm.wait_compiler_key = skip
    nodes = setup_comfyui(comfyui_path(tree), [])
    case = select_cases(case_name)[0]
    with torch.inference_mode():
        subject = build_subject(case, nodes=nodes, device=None, dtype=None, seed=0)
        for _ in range(3):
            subject.stock()
        torch.cuda.synchronize()
        first, _ = timed_call(lambda: subject.decode("high"), subject.device)
        rest = [timed_call(lambda: subject.decode("high"), subject.device)[0] for _ in range(5)]
    steady = statistics.median(rest)
    print(f"RESULT {os.path.basename(tree)} {case_name} prime={mode} first {first:.0f} ms, "
          f"steady {steady:.1f} ms, overhead {first - steady:.0f} ms", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
