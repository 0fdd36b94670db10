"""The stage runtime: stages, pools, graphs and the executor that runs them.

Kept free of heavy imports so that media worker processes can import `stages.media.image`
without pulling in torch.
"""
