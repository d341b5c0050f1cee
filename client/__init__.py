"""What a trainer imports: the reward and trainer clients, weight transfer, adapters for other trainers."""

from rewardmesh._links import only_as

only_as(__name__, "rewardmesh.client")
