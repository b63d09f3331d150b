package selective

import "sync/atomic"

// budget bounds backup requests to a share of the calls: a token bucket
// that every call fills by that share of one backup request, up to
// budgetBurst of them, and every backup request empties by one. Tokens are
// counted in millionths, so that any share down to 0.0001% counts.
type budget struct {
	perCall int64
	tokens  atomic.Int64
	refused atomic.Uint64
}

const (
	tokenUnit   = 1_000_000 // one backup request
	budgetBurst = 10        // backup requests the bucket holds
)

// newBudget returns a full bucket for percent backup requests per call.
func newBudget(percent float64) *budget {
	b := &budget{perCall: max(int64(percent*tokenUnit/100), 1)}
	b.tokens.Store(budgetBurst * tokenUnit)
	return b
}

// deposit adds one call's share.
func (b *budget) deposit() {
	for {
		t := b.tokens.Load()
		if t >= budgetBurst*tokenUnit {
			return
		}
		if b.tokens.CompareAndSwap(t, min(t+b.perCall, budgetBurst*tokenUnit)) {
			return
		}
	}
}

// take spends one backup request, or reports false (and counts a refusal)
// when the bucket holds less than one.
func (b *budget) take() bool {
	for {
		t := b.tokens.Load()
		if t < tokenUnit {
			b.refused.Add(1)
			return false
		}
		if b.tokens.CompareAndSwap(t, t-tokenUnit) {
			return true
		}
	}
}

// available returns how many backup requests the bucket holds now.
func (b *budget) available() float64 { return float64(b.tokens.Load()) / tokenUnit }
