"""Secure aggregation (Bonawitz et al., CCS 2017; SecAgg+, Bell et al., CCS 2020).

A layer around a silo's update (`client.SecureClient`) and the server's sum
(`aggregator.SecureAggregator`); the driver only relays its signed, sealed messages.
"""
