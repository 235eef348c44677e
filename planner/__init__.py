"""The pure planning core: domain types, the reference model, the planner.

Nothing in this package imports grpc, asyncio or torch.
"""
