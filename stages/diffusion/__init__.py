"""The model stages of a diffusion graph (text_encode, denoise, vae_decode) and the denoiser
behind them: step caching, block stacks, regional compile."""
