package hoststate

// Each calls f with the state of every upstream address any config uses,
// in no particular order, until f returns false. Unlike All it builds no
// snapshot and sorts nothing, so a view that shows a page of a large list,
// or counts it, pays only for what it reads.
func Each(f func(*Stats) bool) {
	registry.Range(func(_, v any) bool { return f(v.(*Stats)) })
}
