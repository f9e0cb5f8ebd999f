"""Weight files on the PyTorch backend: a variable's value is a DTensor, each
rank holding one block of it (`dtensor_shards`), and `.weights.h5` files are
saved and loaded one tensor, or one rank's block, at a time (`weights_h5`).
"""
