"""kvstate.transfer"""
