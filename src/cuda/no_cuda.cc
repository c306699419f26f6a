// Placeholder: GPU entry points for builds without CUDA are added by the GPU support work.
