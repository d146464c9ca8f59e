"""kvstate.workloads"""
