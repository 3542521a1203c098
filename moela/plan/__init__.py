"""`python -m moela plan`: what a recipe's layout costs per GPU before any GPU is touched.

One job per file: `layout` (the mesh sizes, pipeline settings and the GPU named on the command line), `memory`
(parameters, gradients, optimizer state and activations per GPU), `comm` (the collectives one step issues, by link),
`timing` (compute from the measured per-family rates, communication by an alpha-beta model, overlap, bubble, MFU),
`search` (the layouts that fit, ranked), `fake_world` (the real model and mesh built at the real world size on a
fake process group: the reference the arithmetic is tested against), `report` (the printed plan).
"""
