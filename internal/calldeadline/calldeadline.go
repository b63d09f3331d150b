// Package calldeadline carries the deadline of an outer combo handler
// (selective) to the combo handlers nested in it (selective, partition),
// which take it instead of their own timeout: brpc's rule that a combo
// channel's timeout overrides its sub-channels'.
package calldeadline

import (
	"context"
	"time"
)

type key struct{}

// With returns ctx carrying deadline for the handlers nested below.
func With(ctx context.Context, deadline time.Time) context.Context {
	return context.WithValue(ctx, key{}, deadline)
}

// From returns the deadline an outer handler set, if any.
func From(ctx context.Context) (time.Time, bool) {
	d, ok := ctx.Value(key{}).(time.Time)
	return d, ok
}
