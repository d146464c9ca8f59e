"""kvstate.report"""
