"""kvstate.depth"""
