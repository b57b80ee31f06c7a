"""The engines and the network: the transport interface, NIXL and Mooncake, placement and NIC affinity, what moved the bytes."""
