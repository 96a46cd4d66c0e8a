"""LoRA-Land's kernels: plain torch (CPU) and Triton (CUDA) LoRA shrink/expand, with the reference beside them.

Imported as `loraland_kernels`, not `kernels`: Hugging Face's `kernels` distribution (a dependency of
transformers >= 5.25) owns the top-level name `kernels`, and a package of ours under that name shadowed it and
broke `import transformers`' model classes. The folder kernels/ has no __init__.py so it never shadows anything;
pyproject.toml maps this package from kernels/loraland_kernels/.
"""
