"""Cluster: Ray placement, actor groups (trainer ranks, engine and router processes), shutdown."""
