"""Rollout: the Sample contract, generate functions, rewards, filters, buffer and manager."""
