"""One file per model family: how to encode the prompt, prepare latents, call the denoiser, decode."""
