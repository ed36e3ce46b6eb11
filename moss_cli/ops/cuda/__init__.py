"""The CUDA op table: CudaOps (table.py: memory, shapes, products, norms, attention) with one mixin per model
family (gdn, conv, dit), over numba device arrays. Importing these modules needs the GPU extra."""
